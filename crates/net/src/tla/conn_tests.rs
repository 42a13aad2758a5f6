//! Tests of the TLA connection core: a simulated peer TCP and server TCP
//! (cumulative acknowledgements, in-order receive, retransmission left to
//! the logger's own timers and the peer's duplicates) exchange segments
//! through a [`TlaConn`] while a server application runs transactions with
//! random aborts and restarts; the peer must receive exactly the committed
//! answers, in order, and never be acknowledged a byte the server's TCP did
//! not receive.

use std::collections::VecDeque;
use std::net::Ipv4Addr;

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use weft_wire::{Incarnation, NodeId};

use super::*;

fn tid(n: u64) -> Tid {
    Tid::new(NodeId(1), Incarnation(1), n)
}

const PEER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 1, 1);

/// A minimal TCP endpoint: in-order receive with cumulative acks, sends
/// what it is given (and keeps it until acknowledged).
struct Ep {
    ip: Ipv4Addr,
    port: u16,
    to_ip: Ipv4Addr,
    to_port: u16,
    isn: u32,
    other_isn: u32,
    snd_una: u64,
    snd_nxt: u64,
    sent: Vec<u8>,
    rcv: Vec<u8>,
    /// Highest acknowledgement received (relative).
    acked_max: u64,
    wscale: u8,
    mss: usize,
    fin_rcvd: bool,
}

impl Ep {
    fn new(ip: Ipv4Addr, port: u16, to_ip: Ipv4Addr, to_port: u16, isn: u32) -> Ep {
        Ep {
            ip,
            port,
            to_ip,
            to_port,
            isn,
            other_isn: 0,
            snd_una: 0,
            snd_nxt: 0,
            sent: Vec::new(),
            rcv: Vec::new(),
            acked_max: 0,
            wscale: 7,
            mss: 1460,
            fin_rcvd: false,
        }
    }

    fn seg(&self, seq: u64, flags: u8, payload: &[u8]) -> Segment {
        Segment {
            src: self.ip,
            dst: self.to_ip,
            sport: self.port,
            dport: self.to_port,
            seq: abs(seq, self.isn),
            ack: abs(
                self.rcv.len() as u64 + u64::from(self.fin_rcvd),
                self.other_isn,
            ),
            flags: flags | ACK,
            window: 4096, // << 7 = 512 KiB
            options: Vec::new(),
            payload: Bytes::copy_from_slice(payload),
        }
    }

    fn syn(&self, ack: bool) -> Segment {
        let mut s = self.seg(0, SYN, &[]);
        s.seq = self.isn;
        if ack {
            s.ack = self.other_isn.wrapping_add(1);
        } else {
            s.flags = SYN;
            s.ack = 0;
        }
        s.options = packet::encode_syn_options(SynOptions {
            mss: Some(self.mss as u16),
            wscale: Some(self.wscale),
        });
        s
    }

    /// Sends `data` in segments of random sizes.
    fn send(&mut self, rng: &mut ChaCha8Rng, data: &[u8]) -> Vec<Segment> {
        self.sent.extend_from_slice(data);
        let mut v = Vec::new();
        while (self.snd_nxt as usize) < self.sent.len() {
            let n = rng
                .gen_range(1..=self.mss)
                .min(self.sent.len() - self.snd_nxt as usize);
            let from = self.snd_nxt as usize;
            v.push(self.seg(self.snd_nxt, PSH, &self.sent[from..from + n]));
            self.snd_nxt += n as u64;
        }
        v
    }

    /// Handles a segment; returns the acknowledgement to send back, if any.
    fn on(&mut self, s: &Segment) -> Option<Segment> {
        assert!(!s.has(RST), "unexpected reset");
        if s.has(ACK) {
            let a = rel(s.ack, self.isn, self.snd_una).expect("ack near");
            assert!(
                a <= self.snd_nxt,
                "acknowledged {a} past what was sent ({})",
                self.snd_nxt
            );
            self.acked_max = self.acked_max.max(a);
            self.snd_una = self.snd_una.max(a);
        }
        let len = s.payload.len() as u64;
        if len == 0 && !s.has(FIN) {
            return None;
        }
        let p = rel(s.seq, self.other_isn, self.rcv.len() as u64).expect("seq near");
        let at = self.rcv.len() as u64;
        if p <= at && at < p + len {
            self.rcv.extend_from_slice(&s.payload[(at - p) as usize..]);
        }
        if s.has(FIN) && p + len == self.rcv.len() as u64 {
            self.fin_rcvd = true;
        }
        Some(self.seg(self.snd_nxt, 0, &[]))
    }
}

struct Sim {
    rng: ChaCha8Rng,
    now: Instant,
    conn: TlaConn,
    peer: Ep,
    server: Ep,
    to_peer: VecDeque<Segment>,
    to_server: VecDeque<Segment>,
    /// Server→logger and peer→logger.
    from_server: VecDeque<Segment>,
    from_peer: VecDeque<Segment>,
    drop_pct: u32,
    reads: ServerReads,
}

impl Sim {
    fn new(seed: u64, drop_pct: u32) -> Sim {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut peer = Ep::new(PEER, 40000, SERVER, 7000, rng.gen());
        let mut server = Ep::new(SERVER, 7000, PEER, 40000, rng.gen());
        peer.mss = rng.gen_range(100..1460);
        server.mss = rng.gen_range(100..1460);
        let now = Instant::now();
        let cfg = TlaConfig {
            logger: LoggerConfig {
                max_hold: 64 * 1024,
                ..LoggerConfig::default()
            },
            rto: Duration::from_millis(200),
            max_segment: 1400,
            idle_timeout: Duration::from_secs(600),
        };
        let (mut conn, syn) = TlaConn::new(cfg, now, &peer.syn(false));
        assert!(syn.options.len() <= 8, "only MSS and window scale pass");
        server.other_isn = peer.isn;
        let synack = server.syn(true);
        let o = conn.on_server(now, &synack).unwrap();
        assert_eq!(o.to_peer.len(), 1);
        peer.other_isn = server.isn;
        let mut sim = Sim {
            rng,
            now,
            conn,
            peer,
            server,
            to_peer: VecDeque::new(),
            to_server: VecDeque::new(),
            from_server: VecDeque::new(),
            from_peer: VecDeque::new(),
            drop_pct,
            reads: ServerReads::default(),
        };
        let ack = sim.peer.seg(0, 0, &[]);
        sim.from_peer.push_back(ack);
        sim.settle();
        sim
    }

    fn take(&mut self, o: Out) {
        self.to_peer.extend(o.to_peer);
        self.to_server.extend(o.to_server);
    }

    fn lossy(&mut self) -> bool {
        self.rng.gen_range(0..100) < self.drop_pct
    }

    /// Delivers everything in flight (the logger's outputs may be lost),
    /// advancing time for retransmissions, until nothing moves.
    fn settle(&mut self) {
        for round in 0..10_000 {
            let mut moved = false;
            while let Some(s) = self.from_peer.pop_front() {
                moved = true;
                let o = self.conn.on_peer(self.now, &s).unwrap();
                self.take(o);
            }
            while let Some(s) = self.from_server.pop_front() {
                moved = true;
                let o = self.conn.on_server(self.now, &s).unwrap();
                self.take(o);
            }
            while let Some(s) = self.to_peer.pop_front() {
                moved = true;
                if self.lossy() {
                    continue;
                }
                // Never acknowledged a peer byte the server did not receive.
                let a = rel(s.ack, self.peer.isn, self.peer.snd_una).unwrap();
                assert!(
                    a <= self.server.rcv.len() as u64,
                    "the peer was acknowledged {a} bytes, the server received {}",
                    self.server.rcv.len()
                );
                if let Some(r) = self.peer.on(&s) {
                    self.from_peer.push_back(r);
                }
            }
            while let Some(s) = self.to_server.pop_front() {
                moved = true;
                if self.lossy() {
                    continue;
                }
                if let Some(r) = self.server.on(&s) {
                    self.from_server.push_back(r);
                }
            }
            if !moved {
                let pending = self.peer.snd_una < self.peer.snd_nxt
                    || self.server.snd_una < self.server.snd_nxt
                    || self.conn.out_una < self.conn.out_end
                    || self.conn.srv_acked < self.conn.srv_next;
                if !pending {
                    return;
                }
                // Time passes: the logger retransmits; the peer too.
                self.now += Duration::from_millis(250);
                let o = self.conn.tick(self.now);
                self.take(o);
                if self.peer.snd_una < self.peer.snd_nxt {
                    let from = self.peer.snd_una as usize;
                    let to = (from + self.peer.mss).min(self.peer.sent.len());
                    let s = self
                        .peer
                        .seg(self.peer.snd_una, PSH, &self.peer.sent[from..to]);
                    self.from_peer.push_back(s);
                }
                if self.server.snd_una < self.server.snd_nxt {
                    let from = self.server.snd_una as usize;
                    let to = (from + self.server.mss).min(self.server.sent.len());
                    let s = self
                        .server
                        .seg(self.server.snd_una, PSH, &self.server.sent[from..to]);
                    self.from_server.push_back(s);
                }
            }
            assert!(round < 9_999, "no quiescence");
        }
    }

    fn server_write(&mut self, data: &[u8]) {
        let segs = self.server.send(&mut self.rng, data);
        self.from_server.extend(segs);
        self.settle();
    }

    fn peer_send(&mut self, data: &[u8]) {
        let segs = self.peer.send(&mut self.rng, data);
        self.from_peer.extend(segs);
        self.settle();
    }

    /// The server application reads `n` bytes (all must have arrived).
    fn server_read(&mut self, n: usize) -> Vec<u8> {
        let avail = self.server.rcv[self.reads.sock as usize..].to_vec();
        let mut got = Vec::new();
        // Take socket bytes one at a time so the read stops at `n`.
        for b in avail {
            if got.len() == n {
                break;
            }
            got.extend_from_slice(self.reads.take(&[b]));
        }
        assert_eq!(got.len(), n, "the server's socket lacks bytes");
        got
    }
}

#[test]
fn handshake_options_are_reduced_and_data_passes_outside_transactions() {
    let mut sim = Sim::new(1, 0);
    sim.peer_send(b"hello");
    assert_eq!(sim.server_read(5), b"hello");
    sim.server_write(b"world");
    assert_eq!(sim.peer.rcv, b"world");
    assert_eq!(
        sim.peer.snd_una, 5,
        "the server's acknowledgement reached the peer"
    );
    assert_eq!(sim.server.snd_una, 5, "the logger acknowledged the server");
}

#[test]
fn an_aborted_answer_leaves_no_hole_and_the_restart_reads_the_request_again() {
    let mut sim = Sim::new(2, 0);
    let now = sim.now;
    sim.peer_send(b"req1");
    sim.conn.start(now, tid(1), 0, 0).unwrap();
    assert_eq!(sim.server_read(4), b"req1");
    sim.server_write(b"aborted answer");
    assert!(sim.peer.rcv.is_empty(), "held");
    assert_eq!(
        sim.server.snd_una, 14,
        "held bytes are acknowledged to the server"
    );
    sim.conn.abort(now, tid(1)).unwrap();
    let in_from = 0;
    let (at, o) = sim.conn.restart(now, tid(2), 14).unwrap();
    assert_eq!(at, 4, "the replay follows what the server received");
    sim.reads.restart(in_from, at);
    sim.take(o);
    sim.settle();
    assert_eq!(sim.server_read(4), b"req1");
    // The peer was acknowledged its 4 bytes, not the replayed copy.
    assert_eq!(sim.peer.acked_max, 4);
    sim.server_write(b"ok");
    sim.conn.end(now, tid(2), 4, 16).unwrap();
    let o = sim.conn.commit(now, tid(2)).unwrap();
    sim.take(o);
    sim.settle();
    assert_eq!(sim.peer.rcv, b"ok", "d2 = 14: the peer sees no hole");
    // Later peer bytes land after the replay (d1 = 4).
    sim.peer_send(b"next");
    assert_eq!(sim.server_read(4), b"next");
    assert_eq!(sim.server.rcv.len(), 12);
    assert_eq!(sim.peer.acked_max, 8);
}

#[test]
fn an_idle_connection_is_forgotten_only_outside_a_transaction() {
    let mut sim = Sim::new(4, 0);
    let now = sim.now;
    let later = now + Duration::from_secs(601);
    assert!(!sim.conn.is_idle(now));
    assert!(sim.conn.is_idle(later));
    sim.conn.start(now, tid(1), 0, 0).unwrap();
    assert!(!sim.conn.is_idle(later), "a running transaction keeps it");
}

#[test]
fn a_reset_passes_at_the_receivers_next_byte_and_ends_the_connection() {
    let mut sim = Sim::new(5, 0);
    sim.peer_send(b"abc");
    let mut rst = sim.peer.seg(3, RST, &[]);
    rst.flags = RST;
    let o = sim.conn.on_peer(sim.now, &rst).unwrap();
    assert_eq!(o.to_server.len(), 1);
    let r = &o.to_server[0];
    assert_eq!(r.flags, RST);
    assert_eq!(
        rel(r.seq, sim.server.other_isn, 0),
        Some(sim.server.rcv.len() as u64)
    );
    assert!(sim.conn.is_closed());
}

#[test]
fn the_servers_fin_waits_for_the_decision_and_follows_the_released_bytes() {
    let mut sim = Sim::new(3, 0);
    let now = sim.now;
    sim.conn.start(now, tid(1), 0, 0).unwrap();
    sim.server_write(b"held");
    let fin = sim.server.seg(4, FIN, &[]);
    sim.server.snd_nxt += 1;
    sim.from_server.push_back(fin);
    sim.settle();
    assert!(
        !sim.peer.fin_rcvd,
        "no FIN while the transaction is undecided"
    );
    let o = sim.conn.abort(now, tid(1)).unwrap();
    sim.take(o);
    sim.settle();
    assert!(sim.peer.fin_rcvd);
    assert!(sim.peer.rcv.is_empty());
}

/// One run of random transactions; returns a description on failure.
fn run(seed: u64, txs: usize, drop_pct: u32) {
    let mut sim = Sim::new(seed, drop_pct);
    let mut expect = Vec::new();
    let mut out_pos = 0u64;
    let mut n = 0;
    // Requests are sent ahead: each transaction's replay lands after bytes
    // of later requests the server already received.
    let reqs: Vec<Vec<u8>> = (0..txs)
        .map(|i| {
            let len = sim.rng.gen_range(1..200);
            (0..len).map(|j| (i * 7 + j) as u8).collect()
        })
        .collect();
    let mut sent = 0;
    for (i, req) in reqs.iter().enumerate() {
        while sent < reqs.len() && (sent <= i || sim.rng.gen_bool(0.3)) {
            let r = reqs[sent].clone();
            sim.peer_send(&r);
            sent += 1;
        }
        n += 1;
        let mut tx = tid(n);
        let in_from = sim.reads.consumed;
        {
            let o = sim.conn.start(sim.now, tx, in_from, out_pos).unwrap();
            sim.take(o);
        }
        sim.settle();
        let mut aborts = sim.rng.gen_range(0..3u32);
        loop {
            assert_eq!(&sim.server_read(req.len()), req, "seed {seed} tx {i}");
            let len = sim.rng.gen_range(1..3000);
            let ans: Vec<u8> = (0..len).map(|j| (n as usize * 31 + j) as u8).collect();
            if aborts > 0 {
                aborts -= 1;
                let half = &ans[..len / 2];
                sim.server_write(half);
                out_pos += half.len() as u64;
                let end_known = sim.rng.gen_bool(0.5);
                if end_known {
                    {
                        let o = sim
                            .conn
                            .end(sim.now, tx, sim.reads.consumed, out_pos)
                            .unwrap();
                        sim.take(o);
                    }
                }
                {
                    let o = sim.conn.abort(sim.now, tx).unwrap();
                    sim.take(o);
                }
                n += 1;
                tx = tid(n);
                let (at, o) = sim.conn.restart(sim.now, tx, out_pos).unwrap();
                sim.reads.restart(in_from, at);
                sim.take(o);
                sim.settle();
                continue;
            }
            sim.server_write(&ans);
            out_pos += ans.len() as u64;
            {
                let o = sim
                    .conn
                    .end(sim.now, tx, sim.reads.consumed, out_pos)
                    .unwrap();
                sim.take(o);
            }
            {
                let o = sim.conn.commit(sim.now, tx).unwrap();
                sim.take(o);
            }
            sim.settle();
            expect.extend_from_slice(&ans);
            break;
        }
        assert_eq!(sim.peer.rcv, expect, "seed {seed}: after tx {i}");
    }
    assert_eq!(sim.peer.rcv, expect, "seed {seed}");
    assert_eq!(
        sim.peer.snd_una, sim.peer.snd_nxt,
        "seed {seed}: every peer byte acknowledged"
    );
    assert_eq!(sim.peer.acked_max, sim.peer.sent.len() as u64);
}

#[test]
fn random_aborts_with_loss() {
    for seed in 0..20 {
        run(1000 + seed, 8, 10);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn the_peer_sees_exactly_the_committed_bytes_and_true_acks(
        seed in any::<u64>(), txs in 1usize..12, drop_pct in 0u32..15,
    ) {
        run(seed, txs, drop_pct);
    }
}
