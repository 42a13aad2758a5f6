//! `weft top`: a live view of the cluster through one node's admin
//! services: per-node rates (commits, aborts, log forces, calls per second),
//! the transactions live anywhere with their age, coordinator and
//! participant tree (in-doubt ones marked), and each node's links with
//! their channel and liveness. `--once --json` prints one snapshot for
//! scripts; off a terminal it prints a text snapshot every interval.
//!
//! Owns sampling (`_status` and `_tx` List of every node in the view,
//! relayed by the node it is connected to), turning two samples into
//! rates, the snapshot's JSON shape and the terminal view. Must never
//! change anything in the cluster: it only reads, and a node that does not
//! answer is shown as unreachable, never a reason to stop.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use serde::Serialize;
use weft::admin::{StatusReport, TxReply, TxRequest, STATUS_SERVICE, TX_SERVICE};
use weft_tx::TxStatus;
use weft_wire::{Address, NodeId, ServiceName};

use crate::client::{parse_duration, Client, ClientOpts};

/// Flags of `weft top`.
#[derive(clap::Args, Debug)]
pub struct TopArgs {
    #[command(flatten)]
    pub client: ClientOpts,
    /// Print one snapshot and exit (rates over one --interval).
    #[arg(long)]
    pub once: bool,
    /// Print JSON (with --once, or one line per interval off a terminal).
    #[arg(long)]
    pub json: bool,
    /// Time between samples (rates are over it); 0 with --once: no rates.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,
}

/// Counters of one node that rates are made of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Counters {
    /// Transactions begun (coordinated) here.
    pub begun: u64,
    /// Transactions coordinated here that committed.
    pub committed: u64,
    /// Transactions coordinated here that aborted.
    pub aborted: u64,
    /// fdatasyncs of the node's log.
    pub forces: u64,
    /// Calls answered by the node (responses sent).
    pub calls: u64,
}

/// Per-second rates between two samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Rates {
    /// Commits per second.
    pub commits_per_s: f64,
    /// Aborts per second.
    pub aborts_per_s: f64,
    /// Log forces per second.
    pub forces_per_s: f64,
    /// Calls answered per second.
    pub calls_per_s: f64,
}

/// One link of a node, as that node sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkView {
    /// The peer.
    pub peer: u32,
    /// The channel in use (`inproc`, `shm`, `tcp`), if linked.
    pub channel: Option<String>,
    /// The node's failure detector thinks the peer is alive.
    pub alive: bool,
    /// Why it is not, when it is not.
    pub cause: Option<String>,
}

/// One node of the snapshot.
#[derive(Clone, Debug, Serialize)]
pub struct NodeView {
    /// Its id.
    pub id: u32,
    /// Its address, as the directory knows it.
    pub addr: Option<String>,
    /// Alive in the view of the node `weft top` is connected to.
    pub alive: bool,
    /// False when it did not answer this sample (see `error`).
    pub reachable: bool,
    /// Why it did not answer.
    pub error: Option<String>,
    /// Its incarnation, when it answered.
    pub incarnation: Option<u32>,
    /// Its counters, when it answered.
    pub counters: Option<Counters>,
    /// Rates since the previous sample (none on the first sample, or after
    /// the node restarted).
    pub rates: Option<Rates>,
    /// Transactions live there.
    pub live_transactions: usize,
    /// Of those, prepared and waiting for their outcome.
    pub in_doubt: usize,
    /// Its links to the other nodes.
    pub links: Vec<LinkView>,
}

/// One transaction's branch at one node.
#[derive(Clone, Debug, Serialize)]
pub struct Branch {
    /// The node.
    pub node: u32,
    /// True at the coordinator.
    pub coordinator: bool,
    /// Phase there.
    pub phase: String,
    /// Prepared there and waiting for the outcome.
    pub in_doubt: bool,
    /// The node that called this branch first.
    pub parent: Option<u32>,
    /// Nodes this branch called.
    pub children: Vec<u32>,
    /// Resources enlisted there.
    pub resources: Vec<String>,
    /// Age there in milliseconds.
    pub age_ms: u64,
}

/// One transaction across the cluster.
#[derive(Clone, Debug, Serialize)]
pub struct TxView {
    /// The transaction.
    pub tid: String,
    /// Its coordinator (the node that created it).
    pub coordinator: u32,
    /// Oldest age of its branches, in milliseconds.
    pub age_ms: u64,
    /// In doubt at some node.
    pub in_doubt: bool,
    /// Its branches, the coordinator's first.
    pub branches: Vec<Branch>,
}

/// What `weft top --once --json` prints.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    /// The node `weft top` is connected to.
    pub via: u32,
    /// Seconds the rates are over (0: no rates).
    pub interval_s: f64,
    /// Every node in the view.
    pub nodes: Vec<NodeView>,
    /// Every transaction live at a node that answered, oldest first.
    pub transactions: Vec<TxView>,
}

/// What one node answered in one sample.
struct NodeSample {
    report: Result<StatusReport, String>,
    txs: Result<Vec<TxStatus>, String>,
}

/// One sample of the whole cluster.
struct Sample {
    at: Instant,
    via: NodeId,
    view: StatusReport,
    nodes: BTreeMap<u32, NodeSample>,
}

fn service(name: &str, node: NodeId) -> Address {
    Address {
        service: ServiceName::new(name).expect("valid name"),
        instance: 0,
        node,
    }
}

/// Asks every node in the view of the connected node for its status and
/// its live transactions.
async fn sample(c: &Client) -> anyhow::Result<Sample> {
    let view: StatusReport = c.call_here(STATUS_SERVICE, ()).await?;
    let at = Instant::now();
    let asks = view.view.nodes.iter().map(|n| {
        let id = n.info.id;
        async move {
            let report = if id == c.gateway() {
                None
            } else {
                Some(
                    c.call::<_, StatusReport>(&service(STATUS_SERVICE, id), (), None)
                        .await
                        .map_err(|f| f.to_string()),
                )
            };
            let txs = c
                .call::<_, TxReply>(&service(TX_SERVICE, id), TxRequest::List, None)
                .await
                .map_err(|f| f.to_string())
                .and_then(|r| match r {
                    TxReply::List(l) => Ok(l),
                    other => Err(format!("unexpected reply {other:?}")),
                });
            (id, report, txs)
        }
    });
    let answers = futures::future::join_all(asks).await;
    let mut nodes = BTreeMap::new();
    for (id, report, txs) in answers {
        let report = report.unwrap_or_else(|| Ok(view.clone()));
        nodes.insert(id.0, NodeSample { report, txs });
    }
    Ok(Sample {
        at,
        via: view.node,
        view,
        nodes,
    })
}

fn counters(r: &StatusReport) -> Counters {
    Counters {
        begun: r.tm.begun,
        committed: r.tm.committed,
        aborted: r.tm.aborted,
        forces: r.log.syncs,
        calls: r.transport.responses,
    }
}

/// Rates from `before` to `now` over `secs`; `None` when a counter went
/// back (the node restarted) or no time passed.
pub fn rates(before: Counters, now: Counters, secs: f64) -> Option<Rates> {
    if secs <= 0.0
        || now.committed < before.committed
        || now.aborted < before.aborted
        || now.forces < before.forces
        || now.calls < before.calls
    {
        return None;
    }
    let per = |a: u64, b: u64| (b - a) as f64 / secs;
    Some(Rates {
        commits_per_s: per(before.committed, now.committed),
        aborts_per_s: per(before.aborted, now.aborted),
        forces_per_s: per(before.forces, now.forces),
        calls_per_s: per(before.calls, now.calls),
    })
}

/// The snapshot of `cur`, with rates against `prev` when given.
fn snapshot(prev: Option<&Sample>, cur: &Sample) -> Snapshot {
    let secs = prev.map_or(0.0, |p| cur.at.duration_since(p.at).as_secs_f64());
    let mut nodes = Vec::new();
    let mut txs: BTreeMap<String, TxView> = BTreeMap::new();
    for n in &cur.view.view.nodes {
        let id = n.info.id.0;
        let s = cur.nodes.get(&id);
        let report = s.and_then(|s| s.report.as_ref().ok());
        let list = s.and_then(|s| s.txs.as_ref().ok());
        let error = s.and_then(|s| s.report.as_ref().err().or(s.txs.as_ref().err()).cloned());
        let c = report.map(counters);
        let before = prev
            .and_then(|p| p.nodes.get(&id))
            .and_then(|s| s.report.as_ref().ok())
            .filter(|r| report.is_some_and(|now| now.incarnation == r.incarnation))
            .map(counters);
        let links = report
            .map(|r| {
                r.view
                    .nodes
                    .iter()
                    .filter(|l| l.info.id.0 != id)
                    .map(|l| LinkView {
                        peer: l.info.id.0,
                        channel: l.channel.map(|c| c.to_string()),
                        alive: l.alive,
                        cause: l.cause.map(|c| c.to_string()),
                    })
                    .collect()
            })
            .unwrap_or_default();
        for t in list.into_iter().flatten() {
            let key = t.tid.to_string();
            let entry = txs.entry(key.clone()).or_insert_with(|| TxView {
                tid: key,
                coordinator: t.tid.node.0,
                age_ms: 0,
                in_doubt: false,
                branches: Vec::new(),
            });
            entry.age_ms = entry.age_ms.max(t.age_ms);
            entry.in_doubt |= t.in_doubt;
            entry.branches.push(Branch {
                node: id,
                coordinator: t.coordinator,
                phase: t.phase.clone(),
                in_doubt: t.in_doubt,
                parent: t.parent.map(|p| p.0),
                children: t.children.iter().map(|c| c.0).collect(),
                resources: t.resources.clone(),
                age_ms: t.age_ms,
            });
        }
        nodes.push(NodeView {
            id,
            addr: n.info.addr.clone(),
            alive: n.alive,
            reachable: error.is_none(),
            error,
            incarnation: report.map(|r| r.incarnation.0),
            counters: c,
            rates: c.zip(before).and_then(|(now, b)| rates(b, now, secs)),
            live_transactions: list.map_or(0, |l| l.len()),
            in_doubt: list.map_or(0, |l| l.iter().filter(|t| t.in_doubt).count()),
            links,
        });
    }
    let mut transactions: Vec<TxView> = txs.into_values().collect();
    for t in &mut transactions {
        t.branches
            .sort_by_key(|b| (!b.coordinator, b.node != t.coordinator, b.node));
    }
    transactions.sort_by(|a, b| b.age_ms.cmp(&a.age_ms).then(a.tid.cmp(&b.tid)));
    Snapshot {
        via: cur.via.0,
        interval_s: (secs * 1000.0).round() / 1000.0,
        nodes,
        transactions,
    }
}

/// Runs `weft top`.
pub async fn run(args: TopArgs) -> anyhow::Result<()> {
    let client = Client::connect(&args.client).await?;
    let result = if args.once {
        once(&client, &args).await
    } else if std::io::stdout().is_terminal() {
        tui::run(&client, args.interval.max(Duration::from_millis(100))).await
    } else {
        stream(&client, &args).await
    };
    client.close().await;
    result
}

/// One snapshot (rates over one interval unless it is 0).
async fn once(client: &Client, args: &TopArgs) -> anyhow::Result<()> {
    let first = sample(client).await?;
    let snap = if args.interval.is_zero() {
        snapshot(None, &first)
    } else {
        tokio::time::sleep(args.interval).await;
        let second = sample(client).await?;
        snapshot(Some(&first), &second)
    };
    print_snapshot(&snap, args.json)
}

/// Off a terminal: a snapshot every interval until interrupted.
async fn stream(client: &Client, args: &TopArgs) -> anyhow::Result<()> {
    let interval = args.interval.max(Duration::from_millis(100));
    let mut prev = sample(client).await?;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = crate::node_cmd::wait_for_signal() => return Ok(()),
        }
        let cur = sample(client).await?;
        print_snapshot(&snapshot(Some(&prev), &cur), args.json)?;
        prev = cur;
    }
}

fn print_snapshot(s: &Snapshot, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    print!("{}", text(s));
    Ok(())
}

fn rate(r: Option<Rates>, f: impl Fn(&Rates) -> f64) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{:.0}", f(&r)))
}

fn links_text(links: &[LinkView]) -> String {
    links
        .iter()
        .map(|l| {
            let state = if l.alive {
                l.channel.clone().unwrap_or_else(|| "up".into())
            } else {
                l.cause.clone().unwrap_or_else(|| "down".into())
            };
            format!("{}:{state}", l.peer)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn branches_text(t: &TxView) -> String {
    t.branches
        .iter()
        .map(|b| {
            format!(
                "{}{}[{}{}]",
                b.node,
                if b.coordinator { "*" } else { "" },
                b.phase,
                if b.in_doubt { "!" } else { "" }
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The plain-text form of a snapshot.
fn text(s: &Snapshot) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<5} {:<22} {:<6} {:>9} {:>8} {:>8} {:>8} {:>5} {:>6}  LINKS",
        "NODE", "ADDR", "STATE", "COMMIT/s", "ABORT/s", "FORCE/s", "CALL/s", "LIVE", "DOUBT"
    );
    for n in &s.nodes {
        let state = match (n.alive, n.reachable) {
            (true, true) => "up",
            (true, false) => "noans",
            (false, _) => "dead",
        };
        let _ = writeln!(
            out,
            "{:<5} {:<22} {:<6} {:>9} {:>8} {:>8} {:>8} {:>5} {:>6}  {}",
            format!("{}{}", n.id, if n.id == s.via { "*" } else { "" }),
            n.addr.clone().unwrap_or_else(|| "-".into()),
            state,
            rate(n.rates, |r| r.commits_per_s),
            rate(n.rates, |r| r.aborts_per_s),
            rate(n.rates, |r| r.forces_per_s),
            rate(n.rates, |r| r.calls_per_s),
            n.live_transactions,
            n.in_doubt,
            links_text(&n.links)
        );
    }
    let _ = writeln!(
        out,
        "{:<18} {:<6} {:>9}  BRANCHES (node[phase], * coordinator, ! in doubt)",
        "TID", "COORD", "AGE"
    );
    for t in &s.transactions {
        let _ = writeln!(
            out,
            "{:<18} {:<6} {:>9}  {}",
            t.tid,
            t.coordinator,
            format!("{}ms", t.age_ms),
            branches_text(t)
        );
    }
    out
}

/// The terminal view.
mod tui {
    use std::time::{Duration, Instant};

    use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
    use ratatui::layout::{Constraint, Layout};
    use ratatui::style::{Modifier, Style};
    use ratatui::widgets::{Block, Paragraph, Row, Table, TableState};
    use ratatui::Frame;

    use super::{
        branches_text, links_text, rate, sample, snapshot, Client, Sample, Snapshot, TxView,
    };

    /// How the transaction list is ordered (the `s` key cycles).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Sort {
        Age,
        Tid,
        Coordinator,
        InDoubt,
    }

    impl Sort {
        fn next(self) -> Sort {
            match self {
                Sort::Age => Sort::Tid,
                Sort::Tid => Sort::Coordinator,
                Sort::Coordinator => Sort::InDoubt,
                Sort::InDoubt => Sort::Age,
            }
        }
        fn name(self) -> &'static str {
            match self {
                Sort::Age => "age",
                Sort::Tid => "tid",
                Sort::Coordinator => "coordinator",
                Sort::InDoubt => "in doubt first",
            }
        }
    }

    /// Orders `txs` by `sort` (ties by tid).
    pub(super) fn order(txs: &mut [TxView], sort: Sort) {
        match sort {
            Sort::Age => txs.sort_by(|a, b| b.age_ms.cmp(&a.age_ms).then(a.tid.cmp(&b.tid))),
            Sort::Tid => txs.sort_by(|a, b| a.tid.cmp(&b.tid)),
            Sort::Coordinator => {
                txs.sort_by(|a, b| a.coordinator.cmp(&b.coordinator).then(a.tid.cmp(&b.tid)))
            }
            Sort::InDoubt => txs.sort_by(|a, b| {
                b.in_doubt
                    .cmp(&a.in_doubt)
                    .then(b.age_ms.cmp(&a.age_ms))
                    .then(a.tid.cmp(&b.tid))
            }),
        }
    }

    struct View {
        snap: Snapshot,
        sort: Sort,
        table: TableState,
        open: Option<String>,
        error: Option<String>,
    }

    pub(super) async fn run(client: &Client, interval: Duration) -> anyhow::Result<()> {
        let mut prev: Option<Sample> = None;
        let first = sample(client).await?;
        let mut view = View {
            snap: snapshot(None, &first),
            sort: Sort::Age,
            table: TableState::default(),
            open: None,
            error: None,
        };
        prev.replace(first);
        let mut terminal = ratatui::try_init()?;
        let result = async {
            let mut next = Instant::now() + interval;
            loop {
                terminal.draw(|f| draw(f, &mut view))?;
                let wait = next.saturating_duration_since(Instant::now());
                let key = tokio::task::block_in_place(|| -> std::io::Result<Option<KeyCode>> {
                    if event::poll(wait.min(Duration::from_millis(250)))? {
                        if let Event::Key(k) = event::read()? {
                            if k.kind == KeyEventKind::Press {
                                return Ok(Some(k.code));
                            }
                        }
                    }
                    Ok(None)
                })?;
                match key {
                    Some(KeyCode::Char('q')) => return Ok(()),
                    Some(KeyCode::Esc) if view.open.is_none() => return Ok(()),
                    Some(KeyCode::Esc) | Some(KeyCode::Backspace) => view.open = None,
                    Some(KeyCode::Char('s')) => {
                        view.sort = view.sort.next();
                        order(&mut view.snap.transactions, view.sort);
                    }
                    Some(KeyCode::Down) | Some(KeyCode::Char('j')) => view.table.select_next(),
                    Some(KeyCode::Up) | Some(KeyCode::Char('k')) => view.table.select_previous(),
                    Some(KeyCode::Enter) => {
                        view.open = view
                            .table
                            .selected()
                            .and_then(|i| view.snap.transactions.get(i))
                            .map(|t| t.tid.clone());
                    }
                    _ => {}
                }
                if Instant::now() >= next {
                    next = Instant::now() + interval;
                    match sample(client).await {
                        Ok(cur) => {
                            let mut snap = snapshot(prev.as_ref(), &cur);
                            order(&mut snap.transactions, view.sort);
                            view.snap = snap;
                            view.error = None;
                            prev = Some(cur);
                        }
                        Err(e) => view.error = Some(format!("{e:#}")),
                    }
                }
            }
        }
        .await;
        ratatui::try_restore()?;
        result
    }

    fn draw(f: &mut Frame, v: &mut View) {
        let [nodes_area, txs_area, help_area] = Layout::vertical([
            Constraint::Length(v.snap.nodes.len() as u16 + 3),
            Constraint::Min(5),
            Constraint::Length(1),
        ])
        .areas(f.area());
        let bold = Style::default().add_modifier(Modifier::BOLD);
        let rows = v.snap.nodes.iter().map(|n| {
            let state = match (n.alive, n.reachable) {
                (true, true) => "up",
                (true, false) => "no answer",
                (false, _) => "dead",
            };
            Row::new(vec![
                format!("{}{}", n.id, if n.id == v.snap.via { "*" } else { "" }),
                n.addr.clone().unwrap_or_else(|| "-".into()),
                state.to_string(),
                rate(n.rates, |r| r.commits_per_s),
                rate(n.rates, |r| r.aborts_per_s),
                rate(n.rates, |r| r.forces_per_s),
                rate(n.rates, |r| r.calls_per_s),
                n.live_transactions.to_string(),
                n.in_doubt.to_string(),
                links_text(&n.links),
            ])
        });
        let nodes = Table::new(
            rows,
            [
                Constraint::Length(5),
                Constraint::Length(22),
                Constraint::Length(9),
                Constraint::Length(9),
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(5),
                Constraint::Length(6),
                Constraint::Min(10),
            ],
        )
        .header(
            Row::new(vec![
                "NODE",
                "ADDR",
                "STATE",
                "COMMIT/s",
                "ABORT/s",
                "FORCE/s",
                "CALL/s",
                "LIVE",
                "DOUBT",
                "LINKS (peer:channel)",
            ])
            .style(bold),
        )
        .block(Block::bordered().title(format!(" weft top via node {} ", v.snap.via)));
        f.render_widget(nodes, nodes_area);
        match v
            .open
            .as_ref()
            .and_then(|tid| v.snap.transactions.iter().find(|t| &t.tid == tid))
        {
            Some(t) => {
                let mut lines = vec![format!(
                    "{} coordinated by node {}, {} ms old{}",
                    t.tid,
                    t.coordinator,
                    t.age_ms,
                    if t.in_doubt { ", IN DOUBT" } else { "" }
                )];
                for b in &t.branches {
                    lines.push(format!(
                        "  node {}{}: {}{}  parent {}  children [{}]  resources [{}]  {} ms",
                        b.node,
                        if b.coordinator { " (coordinator)" } else { "" },
                        b.phase,
                        if b.in_doubt { " (in doubt)" } else { "" },
                        b.parent.map_or("-".to_string(), |p| p.to_string()),
                        b.children
                            .iter()
                            .map(|c| c.to_string())
                            .collect::<Vec<_>>()
                            .join(","),
                        b.resources.join(","),
                        b.age_ms
                    ));
                }
                f.render_widget(
                    Paragraph::new(lines.join("\n"))
                        .block(Block::bordered().title(" transaction (Esc: back) ")),
                    txs_area,
                );
            }
            None => {
                let rows = v.snap.transactions.iter().map(|t| {
                    let row = Row::new(vec![
                        t.tid.clone(),
                        t.coordinator.to_string(),
                        format!("{}ms", t.age_ms),
                        branches_text(t),
                    ]);
                    if t.in_doubt {
                        row.style(Style::default().add_modifier(Modifier::REVERSED))
                    } else {
                        row
                    }
                });
                let table = Table::new(
                    rows,
                    [
                        Constraint::Length(18),
                        Constraint::Length(6),
                        Constraint::Length(10),
                        Constraint::Min(10),
                    ],
                )
                .header(Row::new(vec!["TID", "COORD", "AGE", "BRANCHES"]).style(bold))
                .row_highlight_style(Style::default().add_modifier(Modifier::BOLD))
                .highlight_symbol("> ")
                .block(Block::bordered().title(format!(
                    " {} transactions, sorted by {} ",
                    v.snap.transactions.len(),
                    v.sort.name()
                )));
                f.render_stateful_widget(table, txs_area, &mut v.table);
            }
        }
        let help = match &v.error {
            Some(e) => format!("sample failed: {e}"),
            None => {
                "q quit  s sort  ↑/↓ select  Enter open  Esc back   (* coordinator, ! in doubt)"
                    .to_string()
            }
        };
        f.render_widget(Paragraph::new(help), help_area);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(committed: u64, aborted: u64, forces: u64, calls: u64) -> Counters {
        Counters {
            begun: committed + aborted,
            committed,
            aborted,
            forces,
            calls,
        }
    }

    #[test]
    fn rates_are_differences_over_the_interval() {
        let r = rates(c(10, 2, 5, 100), c(30, 4, 9, 300), 2.0).unwrap();
        assert_eq!(
            r,
            Rates {
                commits_per_s: 10.0,
                aborts_per_s: 1.0,
                forces_per_s: 2.0,
                calls_per_s: 100.0,
            }
        );
        assert_eq!(rates(c(10, 2, 5, 100), c(30, 4, 9, 300), 0.0), None);
        assert_eq!(
            rates(c(10, 2, 5, 100), c(3, 4, 9, 300), 1.0),
            None,
            "a counter that went back (restart) gives no rate"
        );
    }

    fn tx(tid: &str, coord: u32, age: u64, in_doubt: bool) -> TxView {
        TxView {
            tid: tid.into(),
            coordinator: coord,
            age_ms: age,
            in_doubt,
            branches: Vec::new(),
        }
    }

    #[test]
    fn sorting_keys_order_the_transactions() {
        let mut txs = vec![
            tx("t1.1.2", 1, 10, false),
            tx("t2.1.1", 2, 50, false),
            tx("t1.1.1", 1, 5, true),
        ];
        let tids = |t: &[TxView]| t.iter().map(|t| t.tid.clone()).collect::<Vec<_>>();
        tui::order(&mut txs, tui::Sort::Age);
        assert_eq!(tids(&txs), ["t2.1.1", "t1.1.2", "t1.1.1"]);
        tui::order(&mut txs, tui::Sort::Tid);
        assert_eq!(tids(&txs), ["t1.1.1", "t1.1.2", "t2.1.1"]);
        tui::order(&mut txs, tui::Sort::InDoubt);
        assert_eq!(tids(&txs), ["t1.1.1", "t2.1.1", "t1.1.2"]);
        tui::order(&mut txs, tui::Sort::Coordinator);
        assert_eq!(tids(&txs), ["t1.1.1", "t1.1.2", "t2.1.1"]);
    }
}
