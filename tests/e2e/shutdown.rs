//! Shutdown through the binary (issue 45): connections a load balancer still routes during
//! `drain_delay` are served; an open WebSocket does not hold the drain to the end of the grace;
//! an execution cut off at the end of the grace is named in the log.

use std::time::Duration;

use crate::support::redis::free_port;
use crate::support::*;

/// The config of a gateway on a free port with an admin listener on `admin`, in front of `up`.
fn config(up: &str, admin: u16, server: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:{admin}\"\n{server}\n[upstream]\nurl = \"{up}\"\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nmethods = [\"POST\"]\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_accepted_during_the_drain_delay_are_served() {
    let up = Upstream::counting().await;
    let admin = free_port(false);
    let gw = GatewayProcess::start(&config(
        &up.url(),
        admin,
        "drain_delay = \"3s\"\nshutdown_grace = \"5s\"",
    ));
    let admin: std::net::SocketAddr = format!("127.0.0.1:{admin}").parse().unwrap();
    let probe = |path: &'static str| async move { admin_get(admin, path).await.0 };
    assert_eq!(probe("/readyz").await, 200);
    gw.signal("-TERM");
    gw.wait_log("still accepting for drain_delay");
    assert_eq!(
        probe("/readyz").await,
        503,
        "load balancers are told at once"
    );
    // A new connection, as a load balancer that has not noticed yet opens one.
    let got = Http::new(gw.addr).post("/payments", "late-1", "{}").await;
    assert_eq!(got.status, 201, "{got:?}");
    assert_eq!(up.executions(), 1);
    assert!(
        !gw.drain_logs()
            .iter()
            .any(|l| l.contains("draining connections")),
        "served before the drain began"
    );
    gw.wait_log("draining connections");
    gw.wait_log("shut down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_websocket_does_not_hold_the_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = crate::gateway::echo_upstream().await;
    // A grace far longer than the test may take: the process must not wait for it.
    let gw = GatewayProcess::start(&config(
        &format!("http://{echo}"),
        free_port(false),
        "shutdown_grace = \"10m\"",
    ));
    let (mut s, head) = websocket(gw.addr).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    s.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    s.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"ping");

    gw.signal("-TERM");
    // The relay closes the client's socket as the drain starts...
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest)).await;
    assert!(matches!(closed, Ok(Ok(_))), "the WebSocket was not closed");
    // ... and the process ends long before its 10 minute grace.
    gw.wait_log("shut down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_cut_off_by_the_end_of_the_grace_is_named_in_the_log() {
    let up = Upstream::start(|_, _| Reply::Hang).await;
    let text = config(&up.url(), free_port(false), "shutdown_grace = \"1s\"");
    let gw = GatewayProcess::start(&text);
    let http = Http::new(gw.addr);
    let held = tokio::spawn(async move { http.post("/payments", "cut-1", "{}").await });
    up.next_arrival().await;
    gw.signal("-TERM");
    let config = idemgate::config::Config::parse(&text).unwrap();
    let id =
        idemgate::operator::locate(&config, "payments", &["cut-1".into()], &Default::default())
            .unwrap()
            .hex();
    let line = gw.wait_log("cut off by the end of the shutdown grace");
    assert!(line.contains(&id), "the key's id, for the operator: {line}");
    gw.wait_log("shut down");
    held.abort();
}

/// A second SIGTERM during the drain ends the process at once (exit 130), as an operator who
/// will not wait expects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_ends_the_drain_at_once() {
    let up = Upstream::counting().await;
    let gw = GatewayProcess::start(&config(
        &up.url(),
        free_port(false),
        "drain_delay = \"10m\"\nshutdown_grace = \"10m\"",
    ));
    gw.signal("-TERM");
    gw.wait_log("still accepting for drain_delay");
    gw.wait_log("a second SIGTERM or SIGINT now ends the process at once");
    let status = tokio::task::spawn_blocking(move || gw.signal_and_wait("-TERM"))
        .await
        .unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");
}
