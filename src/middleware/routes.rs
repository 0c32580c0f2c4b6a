//! The route table, built once beside axum's router: the front service
//! ([`super::Front`]) needs a request's route *template* before the router
//! runs (the policy, the deadline and the metric label hang on it), and
//! asking the router afterwards meant wrapping every route in layers that
//! axum clones on every request.
//!
//! [`RouteTable`] is the only way to add a route, and it adds each to both,
//! so the two cannot disagree; both match with `matchit` on the raw path,
//! which is what axum's router does.
//!
//! A route whose template has no parameters is then called without the
//! router ([`Route::dispatch`]): the table has matched the path already,
//! and the router would match it again, look its endpoint up, and give the
//! request its (empty) path parameters as an extension, which allocates
//! the request's type map. Only the router can give a handler its path
//! parameters, so a template with any goes through it, and gets the
//! template as a `MatchedPath` beside them (axum's `matched-path`, which
//! [`super::RateLimitLayer`] reads in other apps). The router adds nothing
//! else (its fallback answers paths no route matches), so a layer belongs
//! on a route's [`MethodRouter`] (as the body limit on `/api/orders` is),
//! never on the whole router.

use crate::telemetry::http::{Durations, MethodLabel};
use axum::Router;
use axum::body::Body;
use axum::routing::MethodRouter;
use axum::routing::future::RouteFuture;
use http::{Method, Request};
use std::convert::Infallible;
use std::sync::{Mutex, PoisonError};
use tower::Service as _;

/// The limiter's own refusals: throttled, and unavailable (fail-closed).
const REFUSALS: [u16; 2] = [429, 503];

/// The address of the client a request came from (the connection's peer),
/// given to a [`RouteTable::deciding`] route's handler as an extension.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub Option<std::net::IpAddr>);

/// One route: its template, and whether the limiter decides its requests.
#[derive(Debug)]
pub struct Route {
    /// The template as declared (`/api/items/{id}`): the policy's match,
    /// the `http_route` label.
    pub template: &'static str,
    /// Whether the limiter decides (the API's routes) or never sees it
    /// (health, readiness, metrics: a throttled probe would take a healthy
    /// instance out of its balancer).
    pub limited: bool,
    /// Whether its handler is told the client's address (a [`Peer`]
    /// extension): the decision endpoint, which identifies clients as the
    /// limiter does. Other handlers are not, so their requests keep no
    /// extension (the first one allocates).
    pub peer: bool,
    /// Its request durations, by method and status.
    pub durations: Durations,
    /// Its handlers, for a template without parameters (see the module
    /// docs). Behind a lock only because axum's `MethodRouter` takes
    /// `&mut self` to be called; the call makes the handler's future and
    /// returns, so the lock is held for that much and never across a wait.
    direct: Option<Mutex<MethodRouter>>,
}

impl Route {
    /// Calls the route's handlers with `request`, whose path this route
    /// matched: directly for a template without parameters, else through
    /// `router` (the one the table was built with).
    pub fn dispatch(&self, router: &mut Router, request: Request<Body>) -> RouteFuture<Infallible> {
        match &self.direct {
            Some(handlers) => handlers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .call(request),
            None => router.call(request),
        }
    }
}

/// The templates, matched like axum's router matches them.
#[derive(Debug)]
pub struct Routes {
    matcher: matchit::Router<usize>,
    routes: Vec<Route>,
}

impl Routes {
    /// The route `path` (the URI's, undecoded) matches, if any.
    pub fn find(&self, path: &str) -> Option<&Route> {
        let matched = self.matcher.at(path).ok()?;
        self.routes.get(*matched.value)
    }
}

/// Builds axum's router and [`Routes`] together.
#[derive(Debug)]
pub struct RouteTable<S> {
    router: Router<S>,
    routes: Routes,
    /// Each route's handlers, by its place in `routes`, for a template
    /// without parameters; given the state in [`RouteTable::finish`].
    direct: Vec<Option<MethodRouter<S>>>,
}

impl<S> Default for RouteTable<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn default() -> Self {
        Self {
            router: Router::new(),
            routes: Routes {
                matcher: matchit::Router::new(),
                routes: Vec::new(),
            },
            direct: Vec::new(),
        }
    }
}

impl<S> RouteTable<S>
where
    S: Clone + Send + Sync + 'static,
{
    /// A route the limiter decides, for clients calling it with `methods`.
    /// Their series of the limiter's refusals (429, and 503 when a policy
    /// fails closed) are counted from zero at start: a series born with
    /// its first sample hides it from `rate` and `increase`, so the first
    /// burst of refusals after a start would never show on a panel or an
    /// alert.
    pub fn limited(
        self,
        template: &'static str,
        methods: &[Method],
        handler: MethodRouter<S>,
    ) -> Self {
        let table = self.add(template, handler, true);
        if let Some(route) = table.routes.routes.last() {
            for method in methods {
                route
                    .durations
                    .count_from_zero(MethodLabel::of(method), &REFUSALS);
            }
        }
        table
    }

    /// A route the limiter never sees.
    pub fn unlimited(self, template: &'static str, handler: MethodRouter<S>) -> Self {
        self.add(template, handler, false)
    }

    /// A route the limiter does not decide itself, whose handler decides
    /// for another service's request with the limiter (so is told the
    /// client's address, a [`Peer`]); its refusals counted from zero, as a
    /// limited route's.
    pub fn deciding(
        self,
        template: &'static str,
        methods: &[Method],
        handler: MethodRouter<S>,
    ) -> Self {
        let mut table = self.add(template, handler, false);
        if let Some(route) = table.routes.routes.last_mut() {
            route.peer = true;
            for method in methods {
                route
                    .durations
                    .count_from_zero(MethodLabel::of(method), &REFUSALS);
            }
        }
        table
    }

    fn add(mut self, template: &'static str, handler: MethodRouter<S>, limited: bool) -> Self {
        // `{name}` or `{*rest}`; `{{` and `}}` are literal braces, which
        // leave no parameter (counted as one: the router then serves it).
        let parameters = template.contains('{');
        self.direct.push((!parameters).then(|| handler.clone()));
        // axum panics first on a template it cannot take or a repeat.
        self.router = self.router.route(template, handler);
        self.routes
            .matcher
            .insert(template, self.routes.routes.len())
            .unwrap_or_else(|e| panic!("route {template}: {e}"));
        self.routes.routes.push(Route {
            template,
            limited,
            peer: false,
            durations: Durations::new(template),
            direct: None,
        });
        self
    }

    /// The router and the table, both given `state` (the router's
    /// fallback, for paths no route matches, still to set).
    pub fn finish(self, state: S) -> (Router, Routes) {
        let Self {
            router,
            mut routes,
            direct,
        } = self;
        for (route, handlers) in routes.routes.iter_mut().zip(direct) {
            route.direct = handlers.map(|h| Mutex::new(h.with_state(state.clone())));
        }
        (router.with_state(state), routes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::extract::MatchedPath;
    use axum::routing::get;
    use http::{Request, StatusCode};
    use tower::ServiceExt;

    /// The sample API's templates, each answering with axum's own
    /// `MatchedPath`, so the router says which template it matched.
    fn table() -> (Router, Routes) {
        let echo = || get(|path: MatchedPath| async move { path.as_str().to_owned() });
        let (router, routes) = RouteTable::<()>::default()
            .limited("/api/items", &[Method::GET], echo())
            .limited("/api/items/{id}", &[Method::GET], echo())
            .limited("/api/orders", &[Method::GET], echo())
            .limited("/api/status", &[Method::GET], echo())
            .unlimited("/healthz", echo())
            .finish(());
        (router, routes)
    }

    #[test]
    fn finds_templates_as_declared() {
        let (_, routes) = table();
        let found = |path| routes.find(path).map(|r| (r.template, r.limited));
        assert_eq!(found("/api/items"), Some(("/api/items", true)));
        assert_eq!(found("/api/items/7"), Some(("/api/items/{id}", true)));
        assert_eq!(found("/healthz"), Some(("/healthz", false)));
        assert_eq!(found("/api/items/7/x"), None);
    }

    /// The table and axum's router agree on every path, the odd ones
    /// included: a path the router routes and the table misses would reach
    /// its handler unlimited.
    #[tokio::test]
    async fn agrees_with_axums_router_on_every_path() {
        let (router, routes) = table();
        for path in [
            "/api/items",
            "/api/items/",
            "/api/items/7",
            "/api/items/7/",
            "/api/items/7/x",
            "/api/items/%37",
            "/api/it%65ms",
            "/API/items",
            "//api/items",
            "/api//items",
            "/api/items/{id}",
            "/api/orders",
            "/api/status",
            "/api",
            "/api/",
            "/healthz",
            "/healthz/",
            "/",
            "/nope",
        ] {
            let request = Request::get(path).body(Body::empty()).unwrap();
            let response = router.clone().oneshot(request).await.unwrap();
            let routed = match response.status() {
                StatusCode::OK => {
                    let body = axum::body::to_bytes(response.into_body(), 1024)
                        .await
                        .unwrap();
                    Some(String::from_utf8(body.to_vec()).unwrap())
                }
                StatusCode::NOT_FOUND => None,
                other => panic!("{path}: {other}"),
            };
            assert_eq!(
                routes.find(path).map(|r| r.template.to_owned()),
                routed,
                "{path}"
            );
        }
    }

    /// What a route answers, whole.
    async fn answer(
        future: RouteFuture<Infallible>,
    ) -> (StatusCode, Vec<(String, String)>, Vec<u8>) {
        let Ok(response) = future.await;
        let status = response.status();
        let mut headers: Vec<(String, String)> = response
            .headers()
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        headers.sort();
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, headers, body.to_vec())
    }

    /// A route called directly answers exactly as through axum's router,
    /// for every method (the method router's own 405 with `Allow`, HEAD
    /// by the GET handler, a layer on the route), and only a template
    /// without parameters skips the router.
    #[tokio::test]
    async fn a_direct_call_answers_as_the_router_does() {
        use axum::extract::{DefaultBodyLimit, Path, State};
        use axum::routing::post;
        let (router, routes) = RouteTable::<u32>::default()
            .limited(
                "/items",
                &[Method::GET],
                get(|State(n): State<u32>| async move { format!("items {n}") }),
            )
            .limited(
                "/items/{id}",
                &[Method::GET],
                get(|Path(id): Path<u32>| async move { format!("item {id}") }),
            )
            .limited(
                "/orders",
                &[Method::POST],
                post(|body: String| async move { format!("{} bytes", body.len()) })
                    .layer(DefaultBodyLimit::max(8)),
            )
            .finish(7);
        // A fallback for unmatched paths, as the service sets one: it
        // must not change what a matched route answers to a wrong method.
        let mut router = router.fallback(|| async { (StatusCode::IM_A_TEAPOT, "no such route") });
        assert!(routes.find("/items").unwrap().direct.is_some());
        assert!(
            routes.find("/items/3").unwrap().direct.is_none(),
            "the router gives the parameters"
        );
        let cases: [(&str, &str, &str); 8] = [
            ("GET", "/items", ""),
            ("HEAD", "/items", ""),
            ("POST", "/items", ""),
            ("GET", "/items/3", ""),
            ("DELETE", "/items/3", ""),
            ("POST", "/orders", "1234"),
            ("POST", "/orders", "123456789"),
            ("GET", "/orders", ""),
        ];
        for (method, path, body) in cases {
            let request = || {
                Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::from(body.to_owned()))
                    .unwrap()
            };
            let route = routes.find(path).unwrap();
            let direct = answer(route.dispatch(&mut router, request())).await;
            let routed = answer(router.call(request())).await;
            assert_eq!(direct, routed, "{method} {path}");
        }
        // And what they answer is the handlers' (not two equal errors).
        let route = routes.find("/items").unwrap();
        let request = Request::get("/items").body(Body::empty()).unwrap();
        assert_eq!(
            answer(route.dispatch(&mut router, request)).await.2,
            b"items 7"
        );
        let route = routes.find("/items/3").unwrap();
        let request = Request::get("/items/3").body(Body::empty()).unwrap();
        assert_eq!(
            answer(route.dispatch(&mut router, request)).await.2,
            b"item 3"
        );
    }
}
