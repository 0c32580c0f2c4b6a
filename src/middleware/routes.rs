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
    use axum::routing::get;

    #[test]
    fn finds_templates_as_axum_declares_them() {
        let (_, routes) = RouteTable::<()>::default()
            .limited("/api/items", get(|| async {}))
            .limited("/api/items/{id}", get(|| async {}))
            .unlimited("/healthz", get(|| async {}))
            .finish();
        let found = |path| routes.find(path).map(|r| (r.template, r.limited));
        assert_eq!(found("/api/items"), Some(("/api/items", true)));
        assert_eq!(found("/api/items/7"), Some(("/api/items/{id}", true)));
        assert_eq!(found("/healthz"), Some(("/healthz", false)));
        // As axum: no trailing-slash or case folding, no decoding.
        assert_eq!(found("/api/items/"), None);
        assert_eq!(found("/API/items"), None);
        assert_eq!(found("/api/items/7/x"), None);
        assert_eq!(found("/api/it%65ms"), None);
    }
}
