//! The messages and service of Envoy's rate limit service, generated from
//! Envoy's own protos (`proto/`, with their sources in `proto/README.md`)
//! by `tonic-prost-build`, and committed: building the service needs no
//! protoc. `tests/rls.rs` regenerates them and fails on any difference.
//!
//! Only the packages the service's messages reach are here; the protos'
//! annotation packages (`validate`, `udpa`, `xds.annotations`) carry
//! options prost does not read.
#![allow(missing_docs, missing_debug_implementations, clippy::all)]

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                include!("generated/envoy.config.core.v3.rs");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    include!("generated/envoy.extensions.common.ratelimit.v3.rs");
                }
            }
        }
    }
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                include!("generated/envoy.service.ratelimit.v3.rs");
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            include!("generated/envoy.type.v3.rs");
        }
    }
}

pub mod xds {
    pub mod core {
        pub mod v3 {
            include!("generated/xds.core.v3.rs");
        }
    }
}
