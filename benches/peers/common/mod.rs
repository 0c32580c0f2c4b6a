//! What both peers share with the sample API: `GET /api/items` answered
//! by the sample API's own handler (the same body, byte for byte), served
//! by `axum::serve` on the address given as the first argument, on a
//! tokio runtime as our binary builds it (`#[tokio::main]`, one worker per
//! CPU the process may run on).

pub use ratelimiter::api::list_items;

/// The address to listen on: the first argument.
pub fn listen_address() -> std::net::SocketAddr {
    std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("usage: peer_* <listen address, e.g. 127.0.0.1:8080>"))
}

/// Serves `app` (with the peer address, which governor keys by) until the
/// process is killed.
pub async fn serve(app: axum::Router) {
    let listener = tokio::net::TcpListener::bind(listen_address())
        .await
        .expect("cannot bind the listen address");
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .await
    .expect("serving failed");
}
