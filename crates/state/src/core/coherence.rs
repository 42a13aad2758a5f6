//! Coherence models: when is a cached copy "recent enough"?
//!
//! Owns the pure decision of InterWeave section 2.2, chosen per client per
//! segment: Full (latest), Delta(n) (at most n versions old), Temporal(t) (at
//! most t old), Diff(x%) (at most x% of the segment's units changed since the
//! copy), or a user predicate. The runtime feeds it what it knows (version
//! notices from the home, the time the copy was last known current) and
//! sends a message only when the answer is no.
//!
//! Must never read a clock or the network: time and knowledge come in a
//! [`CacheView`].

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use super::error::StateError;

/// What a client knows about its cached copy when it asks for a read lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheView {
    /// The version of the cached copy.
    pub cached_version: u64,
    /// The newest master version the client has heard of (from a notice or a
    /// reply), if any.
    pub known_master: Option<u64>,
    /// Units changed at the master since the cached version, as the home
    /// reported with its last notice (0 when none reported).
    pub changed_units: u64,
    /// Units in the cached copy.
    pub total_units: u64,
    /// Time since the copy was last known to be the master's latest.
    pub age: Duration,
}

/// A user-defined recency predicate.
pub type Predicate = Arc<dyn Fn(&CacheView) -> bool + Send + Sync>;

/// A coherence model.
#[derive(Clone)]
pub enum Coherence {
    /// Always the master's latest version (every read lock asks the home).
    Full,
    /// At most `n` versions behind the newest known master version.
    Delta(u64),
    /// Known current at most this long ago.
    Temporal(Duration),
    /// At most this percentage (0–100) of the units changed since the copy.
    Diff(f64),
    /// The application decides.
    User(Predicate),
}

impl fmt::Debug for Coherence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Coherence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Coherence::Full => f.write_str("full"),
            Coherence::Delta(n) => write!(f, "delta:{n}"),
            Coherence::Temporal(t) => write!(f, "temporal:{}ms", t.as_millis()),
            Coherence::Diff(p) => write!(f, "diff:{p}"),
            Coherence::User(_) => f.write_str("user"),
        }
    }
}

impl Coherence {
    /// True when the cached copy described by `v` may be used with no
    /// message to the home.
    pub fn recent_enough(&self, v: &CacheView) -> bool {
        match self {
            Coherence::Full => false,
            Coherence::Delta(n) => match v.known_master {
                Some(m) => m.saturating_sub(v.cached_version) <= *n,
                None => false,
            },
            Coherence::Temporal(t) => v.age <= *t,
            Coherence::Diff(p) => {
                if v.total_units == 0 {
                    return v.changed_units == 0;
                }
                (v.changed_units as f64) * 100.0 <= p * (v.total_units as f64)
            }
            Coherence::User(f) => f(v),
        }
    }
}

impl FromStr for Coherence {
    type Err = StateError;

    /// Parses `full`, `delta:N`, `temporal:DUR` (`250ms`, `2s`, `1m`) or
    /// `diff:PCT`. Fails with [`StateError::BadAddress`].
    fn from_str(s: &str) -> Result<Self, StateError> {
        let bad = || StateError::BadAddress(format!("coherence {s:?}"));
        if s == "full" {
            return Ok(Coherence::Full);
        }
        let (k, v) = s.split_once(':').ok_or_else(bad)?;
        match k {
            "delta" => Ok(Coherence::Delta(v.parse().map_err(|_| bad())?)),
            "diff" => {
                let p: f64 = v.trim_end_matches('%').parse().map_err(|_| bad())?;
                if !(0.0..=100.0).contains(&p) {
                    return Err(bad());
                }
                Ok(Coherence::Diff(p))
            }
            "temporal" => {
                let (num, mul) = if let Some(n) = v.strip_suffix("ms") {
                    (n, 1u64)
                } else if let Some(n) = v.strip_suffix('s') {
                    (n, 1000)
                } else if let Some(n) = v.strip_suffix('m') {
                    (n, 60_000)
                } else {
                    return Err(bad());
                };
                let n: u64 = num.parse().map_err(|_| bad())?;
                Ok(Coherence::Temporal(Duration::from_millis(
                    n.checked_mul(mul).ok_or_else(bad)?,
                )))
            }
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> CacheView {
        CacheView {
            cached_version: 10,
            known_master: Some(12),
            changed_units: 5,
            total_units: 100,
            age: Duration::from_millis(300),
        }
    }

    #[test]
    fn each_model_bounds_what_it_says() {
        let v = view();
        assert!(!Coherence::Full.recent_enough(&v));
        assert!(!Coherence::Delta(1).recent_enough(&v));
        assert!(Coherence::Delta(2).recent_enough(&v));
        assert!(!Coherence::Delta(5).recent_enough(&CacheView {
            known_master: None,
            ..v
        }));
        assert!(Coherence::Temporal(Duration::from_millis(300)).recent_enough(&v));
        assert!(!Coherence::Temporal(Duration::from_millis(299)).recent_enough(&v));
        assert!(Coherence::Diff(5.0).recent_enough(&v));
        assert!(!Coherence::Diff(4.9).recent_enough(&v));
        let custom = Coherence::User(Arc::new(|v: &CacheView| v.cached_version < 11));
        assert!(custom.recent_enough(&v));
    }

    #[test]
    fn models_parse_and_print() {
        for s in ["full", "delta:3", "temporal:250ms", "diff:12.5"] {
            assert_eq!(s.parse::<Coherence>().unwrap().to_string(), s);
        }
        assert_eq!(
            "temporal:2s".parse::<Coherence>().unwrap().to_string(),
            "temporal:2000ms"
        );
        for s in [
            "",
            "delta",
            "delta:-1",
            "diff:101",
            "temporal:5",
            "temporal:xs",
            "eventual:1",
        ] {
            assert!(s.parse::<Coherence>().is_err(), "{s}");
        }
    }
}
