//! `weft tls init DIR`: the certificates of a TLS test cluster in one
//! command — a cluster CA, one certificate and key per node, one for
//! clients (see docs/tls.md).
//!
//! Owns the file names and modes. Must never overwrite an existing file
//! unless asked (`--force`), and never write a private key readable by
//! others.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use weft_transport::certs::{ClusterCa, Validity};

/// `weft tls` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum TlsCmd {
    /// Write DIR/ca.crt (and DIR/ca.key), DIR/node-N.crt and DIR/node-N.key
    /// for each node, DIR/client.crt and DIR/client.key.
    Init(InitArgs),
}

/// Flags of `weft tls init`.
#[derive(clap::Args, Debug)]
pub struct InitArgs {
    /// Where to write the files (created if missing).
    pub dir: PathBuf,
    /// The node ids to make certificates for.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub nodes: Vec<u32>,
    /// How many days the certificates are valid.
    #[arg(long, default_value_t = 825)]
    pub days: u32,
    /// Replace files that exist already.
    #[arg(long)]
    pub force: bool,
}

/// Runs `weft tls ...`.
pub async fn run(cmd: TlsCmd) -> anyhow::Result<()> {
    match cmd {
        TlsCmd::Init(a) => init(&a),
    }
}

fn init(a: &InitArgs) -> anyhow::Result<()> {
    if a.nodes.is_empty() {
        bail!("--nodes names no node");
    }
    if let Some(bad) = a.nodes.iter().find(|&&n| n == 0 || n == u32::MAX) {
        bail!("node id {bad} is not a member id (1 to {})", u32::MAX - 1);
    }
    if a.days == 0 {
        bail!("--days must be at least 1");
    }
    let mut names = vec!["ca.crt".to_string(), "ca.key".to_string()];
    for n in &a.nodes {
        names.push(format!("node-{n}.crt"));
        names.push(format!("node-{n}.key"));
    }
    names.push("client.crt".into());
    names.push("client.key".into());
    if !a.force {
        if let Some(there) = names.iter().map(|n| a.dir.join(n)).find(|p| p.exists()) {
            bail!(
                "{} exists already (use --force to replace the cluster's certificates)",
                there.display()
            );
        }
    }
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("cannot create {}", a.dir.display()))?;
    let validity = Validity::days(a.days);
    let ca = ClusterCa::generate(validity)?;
    write(&a.dir.join("ca.crt"), &ca.cert_pem(), false)?;
    write(&a.dir.join("ca.key"), &ca.key_pem(), true)?;
    for &n in &a.nodes {
        let pair = ca.issue_node(n, validity)?;
        write(&a.dir.join(format!("node-{n}.crt")), &pair.cert, false)?;
        write(&a.dir.join(format!("node-{n}.key")), &pair.key, true)?;
    }
    let client = ca.issue_client(validity)?;
    write(&a.dir.join("client.crt"), &client.cert, false)?;
    write(&a.dir.join("client.key"), &client.key, true)?;
    println!(
        "wrote {} files to {} (valid {} days); ca.key signs certificates: keep it offline",
        names.len(),
        a.dir.display(),
        a.days
    );
    Ok(())
}

/// Writes one file; keys are created readable by their owner only.
fn write(path: &Path, text: &str, secret: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    if secret {
        opts.mode(0o600);
    }
    let mut f = opts
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    if secret {
        // An existing file (--force) keeps its mode otherwise.
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    f.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
