//! The two text formats `/metrics` speaks: OpenMetrics, which `prometheus-client` writes and a
//! Prometheus server asks for, and the classic Prometheus text format (0.0.4), for every other
//! reader (`curl`, `promtool check metrics`, older agents), which reads OpenMetrics' counter
//! metadata as belonging to a metric without samples.
//!
//! The samples are the same in both; only the metadata differs: a counter's `# HELP` and
//! `# TYPE` name the family (`x`) in OpenMetrics and the sample (`x_total`) in the classic
//! format, which also has no `# UNIT` lines and no `# EOF`.

use http::header::{HeaderMap, ACCEPT};

/// The media type of each format, as the answer's `Content-Type`.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether the reader asked for OpenMetrics (a Prometheus server names it first in `Accept`);
/// anyone else gets the classic format every Prometheus-compatible reader knows.
pub fn wants_openmetrics(headers: &HeaderMap) -> bool {
    headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|range| {
            let mut parts = range.split(';').map(str::trim);
            let named = parts
                .next()
                .is_some_and(|t| t.eq_ignore_ascii_case("application/openmetrics-text"));
            // A weight of 0 says "not this one".
            let refused = parts
                .filter_map(|p| p.split_once('='))
                .filter(|(name, _)| name.trim().eq_ignore_ascii_case("q"))
                .any(|(_, q)| !q.trim().parse::<f32>().is_ok_and(|q| q > 0.0));
            named && !refused
        })
}

/// The classic text format of an OpenMetrics exposition.
pub fn classic(openmetrics: &str) -> String {
    let counters: Vec<&str> = (openmetrics.lines())
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(&name) {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue};

    #[test]
    fn counters_are_described_by_their_samples_name() {
        let om = "# HELP a_seconds How long.\n# TYPE a_seconds histogram\n# UNIT a_seconds seconds\na_seconds_count 1\n# HELP b Things done.\n# TYPE b counter\nb_total{x=\"1\"} 2\n# HELP c Now.\n# TYPE c gauge\nc 3\n# EOF\n";
        assert_eq!(
            super::classic(om),
            "# HELP a_seconds How long.\n# TYPE a_seconds histogram\na_seconds_count 1\n# HELP b_total Things done.\n# TYPE b_total counter\nb_total{x=\"1\"} 2\n# HELP c Now.\n# TYPE c gauge\nc 3\n"
        );
    }

    #[test]
    fn openmetrics_only_when_asked_for() {
        let accepts = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::ACCEPT, HeaderValue::from_str(v).unwrap());
            super::wants_openmetrics(&h)
        };
        // What a Prometheus 2.x server sends.
        assert!(accepts("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"));
        assert!(accepts("text/plain;q=0.5, Application/OpenMetrics-Text"));
        assert!(!accepts("*/*"));
        assert!(!accepts("text/plain"));
        assert!(!accepts("application/openmetrics-text;q=0, text/plain"));
        assert!(!accepts("application/openmetrics-text; Q = 0.0"));
        assert!(!accepts("application/openmetrics-text;q=NaN"));
        assert!(!super::wants_openmetrics(&HeaderMap::new()));
    }
}
