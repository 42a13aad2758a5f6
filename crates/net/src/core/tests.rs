//! Tests of the logger core: examples of each rule, and a seeded property
//! test that runs a server through random transactions, aborts, restarts,
//! late bytes and reordered control events against a model of what the
//! peer must see.

use super::*;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use weft_wire::{Incarnation, NodeId};

fn tid(n: u64) -> Tid {
    Tid::new(NodeId(1), Incarnation(1), n)
}

fn peer_out(actions: &[Action]) -> Vec<u8> {
    let mut v = Vec::new();
    for a in actions {
        if let Action::ToPeer(b) = a {
            v.extend_from_slice(b);
        }
    }
    v
}

fn to_server(actions: &[Action]) -> Vec<u8> {
    let mut v = Vec::new();
    for a in actions {
        if let Action::ToServer { data, .. } = a {
            v.extend_from_slice(data);
        }
    }
    v
}

fn write(c: &mut LoggerCore, now: Instant, b: &[u8]) -> Result<Vec<Action>, CoreError> {
    c.step(
        now,
        Event::ServerData {
            data: Bytes::copy_from_slice(b),
            refusable: true,
        },
    )
}

#[test]
fn output_is_held_until_commit_and_dropped_at_abort() {
    let now = Instant::now();
    let mut c = LoggerCore::new(LoggerConfig::default());
    // Outside a transaction bytes pass.
    assert_eq!(peer_out(&write(&mut c, now, b"hi").unwrap()), b"hi");
    c.step(
        now,
        Event::Start {
            tx: tid(1),
            in_from: 0,
            out_from: 2,
        },
    )
    .unwrap();
    assert!(peer_out(&write(&mut c, now, b"aborted").unwrap()).is_empty());
    assert_eq!(c.stats().held_bytes, 7);
    assert!(c.step(now, Event::Abort { tx: tid(1) }).unwrap().is_empty());
    assert_eq!(c.stats().held_bytes, 0);
    c.step(
        now,
        Event::Restart {
            tx: tid(2),
            out_from: 9,
        },
    )
    .unwrap();
    assert!(peer_out(&write(&mut c, now, b"kept").unwrap()).is_empty());
    c.step(
        now,
        Event::End {
            tx: tid(2),
            in_end: 0,
            out_end: 13,
        },
    )
    .unwrap();
    assert_eq!(c.state(), ConnState::Commit);
    let out = c.step(now, Event::Commit { tx: tid(2) }).unwrap();
    assert_eq!(peer_out(&out), b"kept");
    assert_eq!(c.state(), ConnState::PreTrans);
    let s = c.stats();
    assert_eq!((s.committed, s.aborted, s.restarted), (1, 1, 1));
}

#[test]
fn peer_bytes_before_start_belong_to_the_next_transaction_and_replay() {
    let now = Instant::now();
    let mut c = LoggerCore::new(LoggerConfig::default());
    c.step(now, Event::PeerData(Bytes::from_static(b"GET /a\n")))
        .unwrap();
    // The server starts its transaction at the bytes it has not read yet.
    c.step(
        now,
        Event::Start {
            tx: tid(1),
            in_from: 0,
            out_from: 0,
        },
    )
    .unwrap();
    let first = to_server(&c.step(now, Event::ServerRead { max: 100 }).unwrap());
    assert_eq!(first, b"GET /a\n");
    c.step(now, Event::Abort { tx: tid(1) }).unwrap();
    c.step(
        now,
        Event::Restart {
            tx: tid(2),
            out_from: 0,
        },
    )
    .unwrap();
    let again = to_server(&c.step(now, Event::ServerRead { max: 100 }).unwrap());
    assert_eq!(again, first, "a restarted transaction reads the same bytes");
    c.step(
        now,
        Event::End {
            tx: tid(2),
            in_end: 7,
            out_end: 0,
        },
    )
    .unwrap();
    c.step(now, Event::Commit { tx: tid(2) }).unwrap();
    assert_eq!(
        c.stats().logged_bytes,
        0,
        "commit purges the transaction's input"
    );
}

#[test]
fn a_write_past_the_hold_limit_fails_with_no_buffer_and_nothing_is_sent() {
    let now = Instant::now();
    let cfg = LoggerConfig {
        max_hold: 10,
        ..LoggerConfig::default()
    };
    let mut c = LoggerCore::new(cfg);
    c.step(
        now,
        Event::Start {
            tx: tid(1),
            in_from: 0,
            out_from: 0,
        },
    )
    .unwrap();
    write(&mut c, now, b"12345678").unwrap();
    let e = write(&mut c, now, b"abc").unwrap_err();
    assert!(matches!(e, CoreError::NoBuffer(_)), "{e}");
    assert_eq!(e.status(), Status::NoBuffer);
    assert_eq!(c.out_pos(), 8, "the refused write took no position");
    write(&mut c, now, b"90").unwrap();
    c.step(
        now,
        Event::End {
            tx: tid(1),
            in_end: 0,
            out_end: 10,
        },
    )
    .unwrap();
    let out = c.step(now, Event::Commit { tx: tid(1) }).unwrap();
    assert_eq!(peer_out(&out), b"1234567890");
}

#[test]
fn late_server_bytes_past_the_limit_doom_the_transaction() {
    let now = Instant::now();
    let cfg = LoggerConfig {
        max_hold: 4,
        ..LoggerConfig::default()
    };
    let mut c = LoggerCore::new(cfg);
    c.step(
        now,
        Event::Start {
            tx: tid(1),
            in_from: 0,
            out_from: 0,
        },
    )
    .unwrap();
    let out = c
        .step(
            now,
            Event::ServerData {
                data: Bytes::from_static(b"too long"),
                refusable: false,
            },
        )
        .unwrap();
    assert!(out.is_empty());
    assert!(c.is_doomed());
    assert_eq!(c.stats().held_bytes, 0);
}

#[test]
fn the_transaction_input_kept_for_replay_is_bounded() {
    let now = Instant::now();
    let cfg = LoggerConfig {
        max_hold: 4,
        ..LoggerConfig::default()
    };
    let mut c = LoggerCore::new(cfg);
    c.step(now, Event::PeerData(Bytes::from_static(b"abcdefgh")))
        .unwrap();
    c.step(
        now,
        Event::Start {
            tx: tid(1),
            in_from: 0,
            out_from: 0,
        },
    )
    .unwrap();
    assert_eq!(
        to_server(&c.step(now, Event::ServerRead { max: 100 }).unwrap()),
        b"abcd"
    );
    let e = c.step(now, Event::ServerRead { max: 100 }).unwrap_err();
    assert!(matches!(e, CoreError::NoBuffer(_)), "{e}");
}

#[test]
fn the_receive_window_is_bounded() {
    let now = Instant::now();
    let cfg = LoggerConfig {
        max_rx: 4,
        ..LoggerConfig::default()
    };
    let mut c = LoggerCore::new(cfg);
    c.step(now, Event::PeerData(Bytes::from_static(b"abc")))
        .unwrap();
    assert_eq!(c.peer_room(), 1);
    let e = c
        .step(now, Event::PeerData(Bytes::from_static(b"de")))
        .unwrap_err();
    assert_eq!(e.status(), Status::NoBuffer);
}

#[test]
fn unclaimed_bytes_age_out_by_size() {
    let now = Instant::now();
    let cfg = LoggerConfig {
        max_unclaimed: 5,
        ..LoggerConfig::default()
    };
    let mut c = LoggerCore::new(cfg);
    c.step(now, Event::PeerData(Bytes::from_static(b"0123456789")))
        .unwrap();
    // Handed to the server outside any transaction: unclaimed.
    c.step(now, Event::ServerRead { max: 10 }).unwrap();
    let s = c.stats();
    assert_eq!((s.logged_bytes, s.aged_out_bytes), (5, 5));
    // A transaction starting inside the aged-out part cannot be replayed.
    c.step(
        now,
        Event::Start {
            tx: tid(1),
            in_from: 2,
            out_from: 0,
        },
    )
    .unwrap();
    c.step(now, Event::Abort { tx: tid(1) }).unwrap();
    let e = c
        .step(
            now,
            Event::Restart {
                tx: tid(2),
                out_from: 0,
            },
        )
        .unwrap_err();
    assert!(matches!(e, CoreError::AgedOut(_)), "{e}");
}

#[test]
fn unclaimed_bytes_age_out_by_time_but_unread_ones_never() {
    let t0 = Instant::now();
    let cfg = LoggerConfig {
        unclaimed_ttl: Duration::from_secs(5),
        ..LoggerConfig::default()
    };
    let mut c = LoggerCore::new(cfg);
    c.step(t0, Event::PeerData(Bytes::from_static(b"old")))
        .unwrap();
    c.step(t0, Event::ServerRead { max: 3 }).unwrap();
    c.step(t0, Event::PeerData(Bytes::from_static(b"unread")))
        .unwrap();
    c.step(t0 + Duration::from_secs(4), Event::Tick).unwrap();
    assert_eq!(c.stats().logged_bytes, 9);
    c.step(t0 + Duration::from_secs(6), Event::Tick).unwrap();
    let s = c.stats();
    assert_eq!((s.logged_bytes, s.aged_out_bytes), (6, 3));
    let got = to_server(&c.step(t0, Event::ServerRead { max: 100 }).unwrap());
    assert_eq!(got, b"unread");
}

#[test]
fn control_events_out_of_place_are_refused() {
    let now = Instant::now();
    let mut c = LoggerCore::new(LoggerConfig::default());
    let e = c
        .step(
            now,
            Event::End {
                tx: tid(1),
                in_end: 0,
                out_end: 0,
            },
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::Mismatch);
    c.step(
        now,
        Event::Start {
            tx: tid(1),
            in_from: 0,
            out_from: 0,
        },
    )
    .unwrap();
    let e = c
        .step(
            now,
            Event::End {
                tx: tid(9),
                in_end: 0,
                out_end: 0,
            },
        )
        .unwrap_err();
    assert!(matches!(e, CoreError::WrongTx { .. }));
    let e = c
        .step(
            now,
            Event::End {
                tx: tid(1),
                in_end: 5,
                out_end: 0,
            },
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::BadRequest);
    c.step(
        now,
        Event::End {
            tx: tid(1),
            in_end: 0,
            out_end: 3,
        },
    )
    .unwrap();
    // The previous transaction is undecided: a new start must wait.
    let e = c
        .step(
            now,
            Event::Start {
                tx: tid(2),
                in_from: 0,
                out_from: 3,
            },
        )
        .unwrap_err();
    assert!(matches!(e, CoreError::Busy(_)));
    // Its output has not all arrived.
    let e = c.step(now, Event::Commit { tx: tid(1) }).unwrap_err();
    assert!(matches!(e, CoreError::Incomplete(_)));
    // An abort for another transaction changes nothing.
    c.step(now, Event::Abort { tx: tid(7) }).unwrap();
    assert_eq!(c.state(), ConnState::Commit);
}

#[test]
fn an_abort_before_the_end_is_known_drops_the_late_tail() {
    let now = Instant::now();
    let mut c = LoggerCore::new(LoggerConfig::default());
    c.step(
        now,
        Event::Start {
            tx: tid(1),
            in_from: 0,
            out_from: 0,
        },
    )
    .unwrap();
    write(&mut c, now, b"abc").unwrap();
    c.step(now, Event::Abort { tx: tid(1) }).unwrap();
    // The rest of the aborted output arrives after the abort, then the
    // server's next non-transactional bytes.
    assert!(peer_out(&write(&mut c, now, b"defXY").unwrap()).is_empty());
    let out = c.step(now, Event::Sync { out_from: 6 }).unwrap();
    assert_eq!(peer_out(&out), b"XY");
    assert_eq!(peer_out(&write(&mut c, now, b"Z").unwrap()), b"Z");
}

// ---- the property test ----

/// The peer's byte at position `p` (so any read can be checked).
fn peer_byte(p: u64) -> u8 {
    (p.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

struct Sim {
    rng: ChaCha8Rng,
    core: LoggerCore,
    now: Instant,
    /// Next peer position to send.
    peer_sent: u64,
    /// How far the peer may send (it sends its requests ahead).
    peer_limit: u64,
    /// Server side: bytes received [consumed, expect).
    inbox: VecDeque<u8>,
    consumed: u64,
    expect: u64,
    /// Server's write position, and its bytes still in flight to the logger.
    out_pos: u64,
    pipe: VecDeque<Bytes>,
    /// What the peer must see, and what it saw.
    expected: Vec<u8>,
    got: Vec<u8>,
    history: Vec<String>,
    seq: u64,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        Sim {
            rng: ChaCha8Rng::seed_from_u64(seed),
            core: LoggerCore::new(LoggerConfig {
                max_hold: 1 << 20,
                max_unclaimed: 1 << 20,
                unclaimed_ttl: Duration::from_secs(3600),
                max_rx: 64,
            }),
            now: Instant::now(),
            peer_sent: 0,
            peer_limit: 0,
            inbox: VecDeque::new(),
            consumed: 0,
            expect: 0,
            out_pos: 0,
            pipe: VecDeque::new(),
            expected: Vec::new(),
            got: Vec::new(),
            history: Vec::new(),
            seq: 0,
        }
    }

    fn step(&mut self, e: Event) -> Result<(), CoreError> {
        self.history.push(format!("{e:?}"));
        self.now += Duration::from_millis(1);
        let actions = self.core.step(self.now, e)?;
        for a in actions {
            match a {
                Action::ToPeer(b) => self.got.extend_from_slice(&b),
                Action::ToServer { pos, data } => {
                    // The 2CA server side: only the next expected position is taken.
                    let end = pos + data.len() as u64;
                    if pos <= self.expect && self.expect < end {
                        let from = (self.expect - pos) as usize;
                        self.inbox.extend(&data[from..]);
                        self.expect = end;
                    }
                }
            }
        }
        Ok(())
    }

    /// One random background step: the peer sends, bytes are forwarded,
    /// server bytes in flight arrive.
    fn background(&mut self) {
        match self.rng.gen_range(0..3) {
            0 => {
                let room = self.core.peer_room() as u64;
                let n = (self.peer_limit - self.peer_sent)
                    .min(room)
                    .min(self.rng.gen_range(1..20));
                if n > 0 {
                    let b: Vec<u8> = (self.peer_sent..self.peer_sent + n)
                        .map(peer_byte)
                        .collect();
                    self.peer_sent += n;
                    self.step(Event::PeerData(Bytes::from(b))).unwrap();
                }
            }
            1 => {
                let max = self.rng.gen_range(1..40);
                // The transaction's read bound is far away in this test.
                self.step(Event::ServerRead { max }).unwrap();
            }
            _ => {
                if let Some(b) = self.pipe.pop_front() {
                    self.step(Event::ServerData {
                        data: b,
                        refusable: false,
                    })
                    .unwrap();
                }
            }
        }
    }

    fn write(&mut self, committed: bool) {
        let n = self.rng.gen_range(1..30);
        let b: Vec<u8> = (0..n).map(|_| self.rng.gen()).collect();
        if committed {
            self.expected.extend_from_slice(&b);
        }
        self.out_pos += n as u64;
        self.pipe.push_back(Bytes::from(b));
    }

    /// The server consumes what it has, checking every byte.
    fn read(&mut self) -> Vec<u8> {
        let n = self.rng.gen_range(0..=self.inbox.len());
        let mut v = Vec::new();
        for _ in 0..n {
            let b = self.inbox.pop_front().unwrap();
            assert_eq!(
                b,
                peer_byte(self.consumed),
                "server read a wrong byte at {}",
                self.consumed
            );
            self.consumed += 1;
            v.push(b);
        }
        v
    }

    fn next_tid(&mut self) -> Tid {
        self.seq += 1;
        tid(self.seq)
    }

    /// One attempt's work; returns what it read.
    fn work(&mut self, will_commit: bool) -> Vec<u8> {
        let mut read = Vec::new();
        for _ in 0..self.rng.gen_range(0..12) {
            match self.rng.gen_range(0..3) {
                0 => self.write(will_commit),
                1 => read.extend(self.read()),
                _ => self.background(),
            }
        }
        read
    }

    fn run(&mut self, txs: usize) {
        for _ in 0..txs {
            self.peer_limit += self.rng.gen_range(0..50);
            if self.rng.gen_bool(0.3) {
                // Non-transactional output between transactions.
                self.write(true);
            }
            for _ in 0..self.rng.gen_range(0..4) {
                self.background();
            }
            let t1 = self.next_tid();
            let (in_from, out_from) = (self.consumed, self.out_pos);
            self.step(Event::Start {
                tx: t1,
                in_from,
                out_from,
            })
            .unwrap();
            let mut t = t1;
            if self.rng.gen_bool(0.4) {
                // An attempt that aborts, before or after its end is known.
                let first = self.work(false);
                if self.rng.gen_bool(0.5) {
                    self.step(Event::End {
                        tx: t1,
                        in_end: self.consumed,
                        out_end: self.out_pos,
                    })
                    .unwrap();
                }
                for _ in 0..self.rng.gen_range(0..3) {
                    self.background();
                }
                self.step(Event::Abort { tx: t1 }).unwrap();
                for _ in 0..self.rng.gen_range(0..3) {
                    self.background();
                }
                // TX_RESTART: the server forgets what it had and reads again.
                self.inbox.clear();
                self.consumed = in_from;
                self.expect = in_from;
                t = self.next_tid();
                self.step(Event::Restart {
                    tx: t,
                    out_from: self.out_pos,
                })
                .unwrap();
                // It reads at least what the aborted attempt read.
                let mut again = Vec::new();
                while again.len() < first.len() {
                    self.background();
                    again.extend(self.read());
                }
                assert_eq!(
                    &again[..first.len()],
                    &first[..],
                    "a restart reads the same bytes"
                );
            }
            self.work(true);
            self.step(Event::End {
                tx: t,
                in_end: self.consumed,
                out_end: self.out_pos,
            })
            .unwrap();
            loop {
                match self.step(Event::Commit { tx: t }) {
                    Ok(()) => break,
                    Err(CoreError::Incomplete(_)) => {
                        let b = self
                            .pipe
                            .pop_front()
                            .expect("incomplete means bytes in flight");
                        self.step(Event::ServerData {
                            data: b,
                            refusable: false,
                        })
                        .unwrap();
                    }
                    Err(e) => panic!("commit: {e}"),
                }
            }
        }
        while let Some(b) = self.pipe.pop_front() {
            self.step(Event::ServerData {
                data: b,
                refusable: false,
            })
            .unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The peer sees exactly the committed output (and the output written
    /// outside transactions), in order; restarted transactions read what
    /// the aborted attempt read; every byte the server reads is the peer's
    /// byte at that position.
    #[test]
    fn the_peer_sees_exactly_the_committed_bytes(seed in any::<u64>(), txs in 1usize..25) {
        // A panic inside (a wrong byte read) is reported with its seed by proptest.
        let mut sim = Sim::new(seed);
        sim.run(txs);
        let tail: Vec<&String> = sim.history.iter().rev().take(40).collect();
        prop_assert_eq!(&sim.got, &sim.expected, "seed {}; last events (newest first): {:?}", seed, tail);
    }
}
