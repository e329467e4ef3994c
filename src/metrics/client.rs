//! How clients were told apart: tokens refused on `client_jwt` routes, JWTs seen in a plain
//! `client_header` (the scope then changes with every token refresh), and key set fetches.
//!
//! - `idemgate_client_unverified_total{route, reason}`: keyed requests refused `401
//!   client-unverified`, by why (`malformed`, `unknown_key`, `algorithm`, `signature`,
//!   `expired`, `not_yet_valid`, `issuer`, `audience`, `claim_missing`).
//! - `idemgate_client_header_jwt_total{route}`: requests whose `client_header` value is a JWT.
//! - `idemgate_jwks_fetches_total{result}`: key set fetches (`ok`, `failed`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::{registered, Metrics, ResultLabel, RouteLabel, RouteMetrics};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UnverifiedLabels {
    route: String,
    reason: &'static str,
}

pub(super) struct ClientMetrics {
    unverified: Family<UnverifiedLabels, Counter>,
    jwt_in_header: Family<RouteLabel, Counter>,
    jwks_fetches: Family<ResultLabel, Counter>,
}

impl ClientMetrics {
    pub(super) fn new(r: &mut Registry) -> Self {
        ClientMetrics {
            unverified: registered(
                r,
                "client_unverified",
                "Keyed requests whose client_jwt token did not verify, by route and reason",
            ),
            jwt_in_header: registered(
                r,
                "client_header_jwt",
                "Requests scoped by a client_header whose value is a JWT (its scope changes with each token refresh: use client_jwt)",
            ),
            jwks_fetches: registered(
                r,
                "jwks_fetches",
                "Fetches of client_jwt key sets, by result (ok, failed)",
            ),
        }
    }
}

impl Metrics {
    /// A token refused on `route`, and why.
    pub fn client_unverified(&self, route: &RouteMetrics, reason: &'static str) {
        (self.client.unverified)
            .get_or_create(&UnverifiedLabels {
                route: route.route.clone(),
                reason,
            })
            .inc();
    }

    /// A request on `route` whose client header carries a JWT.
    pub fn jwt_in_client_header(&self, route: &RouteMetrics) {
        (self.client.jwt_in_header)
            .get_or_create(&RouteLabel {
                route: route.route.clone(),
            })
            .inc();
    }

    /// A key set fetched (`ok`) or not (`failed`).
    pub fn jwks_fetch(&self, result: &'static str) {
        (self.client.jwks_fetches)
            .get_or_create(&ResultLabel { result })
            .inc();
    }
}
