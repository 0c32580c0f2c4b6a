//! The route table, built once beside axum's router: the front service
//! ([`super::Front`]) needs a request's route *template* before the router
//! runs (the policy, the deadline and the metric label hang on it), and
//! asking the router afterwards meant wrapping every route in layers that
//! axum clones on every request.
//!
//! [`RouteTable`] is the only way to add a route, and it adds each to both,
//! so the two cannot disagree; both match with `matchit` on the raw path,
//! which is what axum's router does.

use crate::telemetry::http::Durations;
use axum::Router;
use axum::routing::MethodRouter;

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
    /// Its request durations, by method and status.
    pub durations: Durations,
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
        }
    }
}

impl<S> RouteTable<S>
where
    S: Clone + Send + Sync + 'static,
{
    /// A route the limiter decides.
    pub fn limited(self, template: &'static str, handler: MethodRouter<S>) -> Self {
        self.add(template, handler, true)
    }

    /// A route the limiter never sees.
    pub fn unlimited(self, template: &'static str, handler: MethodRouter<S>) -> Self {
        self.add(template, handler, false)
    }

    fn add(mut self, template: &'static str, handler: MethodRouter<S>, limited: bool) -> Self {
        // axum panics first on a template it cannot take or a repeat.
        self.router = self.router.route(template, handler);
        self.routes
            .matcher
            .insert(template, self.routes.routes.len())
            .unwrap_or_else(|e| panic!("route {template}: {e}"));
        self.routes.routes.push(Route {
            template,
            limited,
            durations: Durations::new(template),
        });
        self
    }

    /// The router (its fallback and state still to set) and the table.
    pub fn finish(self) -> (Router<S>, Routes) {
        (self.router, self.routes)
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
            .limited("/api/items", echo())
            .limited("/api/items/{id}", echo())
            .limited("/api/orders", echo())
            .limited("/api/status", echo())
            .unlimited("/healthz", echo())
            .finish();
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
}
