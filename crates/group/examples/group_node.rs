//! A node with the group layer and its `_group` service, listening on TCP,
//! to try `weft group ...` by hand before `weft node` carries the plugin:
//! `cargo run -p weft-group --example group_node -- 127.0.0.1:7000 [SECRET]`.

use std::time::Duration;

use weft_group::config::GroupConfig;
use weft_group::runtime::Groups;
use weft_log::{Log, LogConfig};
use weft_rpc::{Rpc, RpcConfig};
use weft_transport::{Endpoint, TransportConfig};
use weft_tx::{TmConfig, TxManager};
use weft_wire::{Incarnation, NodeId};

#[tokio::main]
async fn main() {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7000".into())
        .parse()
        .expect("HOST:PORT");
    let secret = std::env::args().nth(2).unwrap_or_default();
    let dir = tempfile::tempdir().expect("temporary directory");
    let (log, _) = Log::open(LogConfig::new(dir.path().join("log"))).expect("log");
    let ep = Endpoint::start(TransportConfig {
        listen: Some(listen),
        secret: secret.into_bytes(),
        ..TransportConfig::node(NodeId(1), Incarnation(1))
    })
    .await
    .expect("endpoint");
    let tm = TxManager::start(ep.clone(), log, TmConfig::default());
    let rpc = Rpc::new(ep.clone(), tm.clone(), RpcConfig::default());
    let groups = Groups::start(ep.clone(), Some(tm), GroupConfig::default()).expect("groups");
    weft_group::service::install_service(&rpc, &groups).expect("_group");
    println!(
        "group node listening on {}",
        ep.listen_addr().expect("listening")
    );
    loop {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
}
