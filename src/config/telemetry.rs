//! `[telemetry]`: traces exported over OTLP/HTTP (off when the section is absent). The
//! OpenTelemetry environment variables fill what the file leaves unset ([`Telemetry::with_env`]):
//! the file wins where both say something.

use std::collections::BTreeMap;

use super::ConfigError;

/// The OTLP/HTTP receiver's conventional address (the OpenTelemetry spec's default).
const DEFAULT_ENDPOINT: &str = "http://localhost:4318";
/// Resource attributes kept; more would be sent with every export for nothing.
const MAX_ATTRIBUTES: usize = 32;

/// `[telemetry]` as written.
#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    otlp_endpoint: Option<String>,
    sample_ratio: Option<f64>,
    service_name: Option<String>,
    resource_attributes: Option<BTreeMap<String, String>>,
    trace_passthrough: Option<bool>,
}

/// `[telemetry]`, validated; `None` fields are left to the environment, then the defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Telemetry {
    otlp_endpoint: Option<String>,
    sample_ratio: Option<f64>,
    service_name: Option<String>,
    resource_attributes: BTreeMap<String, String>,
    trace_passthrough: bool,
}

/// What the exporter runs with, once the environment was read.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// The base URL; spans go to `{otlp_endpoint}/v1/traces`.
    pub otlp_endpoint: String,
    /// Of the traces that start here (a caller's sampled trace is always continued).
    pub sample_ratio: f64,
    pub service_name: String,
    pub resource_attributes: BTreeMap<String, String>,
    /// A span for every request outside the routes too (off by default: they are most of the
    /// traffic, and the gateway decides nothing about them).
    pub trace_passthrough: bool,
}

impl Telemetry {
    pub(super) fn validate(raw: RawTelemetry) -> Result<Telemetry, ConfigError> {
        if let Some(url) = &raw.otlp_endpoint {
            endpoint("telemetry.otlp_endpoint", url)?;
        }
        if let Some(r) = raw.sample_ratio {
            if !(0.0..=1.0).contains(&r) {
                return Err(ConfigError::invalid(
                    "telemetry.sample_ratio",
                    r.to_string(),
                    "a fraction from 0.0 (only callers' sampled traces) to 1.0 (every request, the default)",
                ));
            }
        }
        if raw.service_name.as_deref().is_some_and(str::is_empty) {
            return Err(ConfigError::invalid(
                "telemetry.service_name",
                "",
                "a name for this service in the traces (\"idemgate\" is the default)",
            ));
        }
        let attributes = raw.resource_attributes.unwrap_or_default();
        if attributes.len() > MAX_ATTRIBUTES || attributes.keys().any(String::is_empty) {
            return Err(ConfigError::invalid(
                "telemetry.resource_attributes",
                format!("({} entries)", attributes.len()),
                "up to 32 attributes with non-empty names, such as { \"deployment.environment\" = \"prod\" }",
            ));
        }
        Ok(Telemetry {
            otlp_endpoint: raw.otlp_endpoint,
            sample_ratio: raw.sample_ratio,
            service_name: raw.service_name,
            resource_attributes: attributes,
            trace_passthrough: raw.trace_passthrough.unwrap_or(false),
        })
    }

    /// The settings with the environment's where the file has none: `OTEL_EXPORTER_OTLP_ENDPOINT`,
    /// `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER` (`always_on`, `always_off`, `traceidratio` and
    /// their `parentbased_` forms) with `OTEL_TRACES_SAMPLER_ARG`, `OTEL_RESOURCE_ATTRIBUTES`
    /// (`k=v,k=v`; the file's attributes win per name).
    ///
    /// As the OpenTelemetry spec says, an empty variable is unset, and one it cannot use is
    /// left for the default with a warning (returned, for the log): variables set for a whole
    /// cluster must not stop the gateway.
    pub fn with_env(&self, env: impl Fn(&str) -> Option<String>) -> (Resolved, Vec<String>) {
        let env = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let mut warnings = Vec::new();
        let mut warn = |e: ConfigError| warnings.push(format!("{e}; the default is used"));
        let otlp_endpoint = match (&self.otlp_endpoint, env("OTEL_EXPORTER_OTLP_ENDPOINT")) {
            (Some(url), _) => url.clone(),
            (None, Some(url)) => {
                endpoint("OTEL_EXPORTER_OTLP_ENDPOINT", &url).unwrap_or_else(|e| {
                    warn(e);
                    DEFAULT_ENDPOINT.into()
                })
            }
            (None, None) => DEFAULT_ENDPOINT.into(),
        };
        let sample_ratio = match self.sample_ratio {
            Some(r) => r,
            None => sampler_from_env(&env).unwrap_or_else(|e| {
                warn(e);
                1.0
            }),
        };
        let service_name = self
            .service_name
            .clone()
            .or_else(|| env("OTEL_SERVICE_NAME").filter(|s| !s.is_empty()))
            .unwrap_or_else(|| "idemgate".into());
        let mut resource_attributes: BTreeMap<String, String> = env("OTEL_RESOURCE_ATTRIBUTES")
            .map(|list| {
                list.split(',')
                    .filter_map(|pair| pair.split_once('='))
                    .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                    .filter(|(k, _)| !k.is_empty())
                    .take(MAX_ATTRIBUTES)
                    .collect()
            })
            .unwrap_or_default();
        resource_attributes.extend(self.resource_attributes.clone());
        // The service's name is `service_name`'s alone, whatever the attributes say.
        resource_attributes.remove("service.name");
        let resolved = Resolved {
            otlp_endpoint: otlp_endpoint.trim_end_matches('/').to_string(),
            sample_ratio,
            service_name,
            resource_attributes,
            trace_passthrough: self.trace_passthrough,
        };
        (resolved, warnings)
    }
}

/// An `http://` base URL without credentials (none shown in errors): the exporter has no TLS
/// yet, and would send no credentials written in a URL.
fn endpoint(field: &str, url: &str) -> Result<String, ConfigError> {
    let parsed: Result<http::Uri, _> = url.parse();
    match parsed {
        Ok(uri)
            if uri.scheme_str() == Some("http")
                && uri.authority().is_some_and(|a| !a.as_str().contains('@'))
                && uri.query().is_none() =>
        {
            Ok(url.to_string())
        }
        _ => Err(ConfigError::invalid(
            field,
            super::redact_url(url),
            "the OTLP/HTTP receiver's base URL, such as \"http://otel-collector:4318\" (spans go to /v1/traces under it): http:// without credentials (a collector beside the gateway; https:// is not supported yet)",
        )),
    }
}

/// The ratio `OTEL_TRACES_SAMPLER` and its argument say; 1.0 when unset. Every sampler here
/// is parent-based: a caller's decision is kept, whatever the name says.
fn sampler_from_env(env: &impl Fn(&str) -> Option<String>) -> Result<f64, ConfigError> {
    let Some(name) = env("OTEL_TRACES_SAMPLER") else {
        return Ok(1.0);
    };
    let ratio = || -> Result<f64, ConfigError> {
        match env("OTEL_TRACES_SAMPLER_ARG") {
            None => Ok(1.0),
            Some(arg) => arg
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| {
                    ConfigError::invalid(
                        "OTEL_TRACES_SAMPLER_ARG",
                        arg,
                        "a fraction from 0.0 to 1.0",
                    )
                }),
        }
    };
    match name.trim() {
        "always_on" | "parentbased_always_on" => Ok(1.0),
        "always_off" | "parentbased_always_off" => Ok(0.0),
        "traceidratio" | "parentbased_traceidratio" => ratio(),
        other => Err(ConfigError::invalid(
            "OTEL_TRACES_SAMPLER",
            other,
            "always_on, always_off, traceidratio, or their parentbased_ forms",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    fn empty() -> Telemetry {
        Telemetry::validate(RawTelemetry::default()).unwrap()
    }

    #[test]
    fn the_environment_fills_what_the_file_leaves_unset() {
        let (none, warnings) = empty().with_env(env(&[]));
        assert!(warnings.is_empty());
        assert_eq!(none.otlp_endpoint, "http://localhost:4318");
        assert_eq!(none.sample_ratio, 1.0);
        assert_eq!(none.service_name, "idemgate");
        let from_env = empty()
            .with_env(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
                ("OTEL_SERVICE_NAME", "payments-gateway"),
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "deployment.environment=prod, team=pay",
                ),
            ]))
            .0;
        assert_eq!(from_env.otlp_endpoint, "http://collector:4318");
        assert_eq!(from_env.service_name, "payments-gateway");
        assert_eq!(from_env.sample_ratio, 0.25);
        assert_eq!(from_env.resource_attributes["team"], "pay");
    }

    #[test]
    fn the_file_wins_where_both_are_set() {
        let mut attributes = BTreeMap::new();
        attributes.insert("team".to_string(), "core".to_string());
        let file = Telemetry::validate(RawTelemetry {
            otlp_endpoint: Some("http://otel.example:4318".into()),
            sample_ratio: Some(0.5),
            service_name: Some("edge".into()),
            resource_attributes: Some(attributes),
            trace_passthrough: None,
        })
        .unwrap();
        let got = file
            .with_env(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4318"),
                ("OTEL_SERVICE_NAME", "other"),
                ("OTEL_TRACES_SAMPLER", "always_off"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "team=pay,region=eu,service.name=other",
                ),
            ]))
            .0;
        assert_eq!(got.otlp_endpoint, "http://otel.example:4318");
        assert!(!got.resource_attributes.contains_key("service.name"));
        assert_eq!(got.sample_ratio, 0.5);
        assert_eq!(got.service_name, "edge");
        assert_eq!(got.resource_attributes["team"], "core");
        assert_eq!(got.resource_attributes["region"], "eu");
    }

    #[test]
    fn bad_values_are_refused_naming_where_they_came_from() {
        let bad = |raw: RawTelemetry| match Telemetry::validate(raw) {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            bad(RawTelemetry {
                sample_ratio: Some(1.5),
                ..Default::default()
            }),
            "telemetry.sample_ratio"
        );
        assert_eq!(
            bad(RawTelemetry {
                otlp_endpoint: Some("collector:4318".into()),
                ..Default::default()
            }),
            "telemetry.otlp_endpoint"
        );
        for url in ["https://collector:4318", "http://user:pw@collector:4318"] {
            assert_eq!(
                bad(RawTelemetry {
                    otlp_endpoint: Some(url.into()),
                    ..Default::default()
                }),
                "telemetry.otlp_endpoint"
            );
        }
        // The environment's mistakes are warned about and left for the defaults; empty is unset.
        let from_env = |pairs: &[(&str, &str)]| empty().with_env(env(pairs));
        let (got, warnings) = from_env(&[("OTEL_TRACES_SAMPLER", "jaeger_remote")]);
        assert_eq!((got.sample_ratio, warnings.len()), (1.0, 1), "{warnings:?}");
        assert!(warnings[0].contains("OTEL_TRACES_SAMPLER"), "{warnings:?}");
        let (got, warnings) = from_env(&[
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "2"),
        ]);
        assert_eq!((got.sample_ratio, warnings.len()), (1.0, 1));
        let (got, warnings) = from_env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://x")]);
        assert_eq!(got.otlp_endpoint, "http://localhost:4318");
        assert_eq!(warnings.len(), 1);
        let (got, warnings) = from_env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
            ("OTEL_TRACES_SAMPLER", " "),
            ("OTEL_SERVICE_NAME", ""),
        ]);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(got.otlp_endpoint, "http://localhost:4318");
        assert_eq!(got.service_name, "idemgate");
    }
}
