//! `weft bench soak` end to end, briefly: it runs, samples, audits and
//! writes the figures issue 23's targets are read from.

mod common;

#[test]
fn a_short_soak_writes_its_figures_and_passes_the_audit() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("soak.json");
    let out = common::weft()
        .args(["bench", "soak", "--duration", "3s", "--every", "1s"])
        .args(["--sites", "2", "--clients", "4", "--dir"])
        .arg(dir.path())
        .arg("--json")
        .arg(&json)
        .output()
        .expect("weft runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "soak failed:\n{stdout}\n{stderr}");
    assert!(
        stderr.lines().filter(|l| l.contains(" committed ")).count() >= 3,
        "a progress line per sample, off a terminal too:\n{stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for key in [
        "rss_mib_at_2min",
        "rss_mib_end",
        "tps_first_min",
        "tps_last_min",
        "checkpoint_ms_max",
    ] {
        assert!(v[key].as_f64().is_some(), "{key} missing: {v}");
    }
    assert_eq!(v["audit_passed"], true, "{v}");
    assert!(v["rss_mib_end"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["committed"].as_u64().unwrap() > 0, "{v}");
    assert!(
        v["checkpoint_ms_max"].as_f64().unwrap() > 0.0,
        "the final checkpoint is measured: {v}"
    );
    let samples = v["samples"].as_array().unwrap();
    assert!(samples.len() >= 4, "t = 0, then one a second: {v}");
    assert!(samples.iter().all(|s| s["rss_mib"].as_f64().unwrap() > 0.0));
}
