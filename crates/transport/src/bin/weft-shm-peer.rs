//! The shm helper process of the transport's two-process tests: runs
//! `weft_transport::shm::bench::peer_main` on its arguments (see that module
//! for the modes). The `weft` CLI embeds the same helper behind a hidden
//! first argument instead.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(weft_transport::shm::bench::peer_main(args));
}
