//! What both peers share with the sample API: `GET /api/items` answering
//! the same JSON body (`api.rs`'s catalogue, byte for byte), served by
//! `axum::serve` on the address given as the first argument, on a tokio
//! runtime as our binary builds it (`#[tokio::main]`, one worker per CPU
//! the process may run on).

use axum::Json;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Item {
    id: u32,
    name: &'static str,
    price_cents: u32,
}

/// The same catalogue, in the same order, as `api.rs`.
const ITEMS: [Item; 3] = [
    Item {
        id: 1,
        name: "token",
        price_cents: 100,
    },
    Item {
        id: 2,
        name: "bucket",
        price_cents: 2_500,
    },
    Item {
        id: 3,
        name: "sliding window",
        price_cents: 4_000,
    },
];

/// The handler of `GET /api/items`.
pub async fn list_items() -> Json<&'static [Item]> {
    Json(&ITEMS)
}

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
