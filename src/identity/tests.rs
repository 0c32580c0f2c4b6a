use super::*;
use http::HeaderValue;
use proptest::prelude::*;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn identifier(trusted: &[&str]) -> Identifier {
    Identifier::new(
        ApiKeys::from_digests([("tenant-a".to_owned(), ApiKeys::digest("key-a"))]),
        trusted.iter().map(|n| n.parse().unwrap()).collect(),
        64,
    )
}

#[test]
fn verified_api_key_wins_over_address() {
    let id = identifier(&[]);
    let (who, kind) = id
        .identify(&headers(&[("x-api-key", "key-a")]), Some(ip("10.0.0.1")))
        .unwrap();
    assert_eq!(who, Identity::ApiKey("tenant-a".into()));
    assert_eq!(kind, KeyKind::ApiKey);
    let (who, _) = id
        .identify(
            &headers(&[("authorization", "Bearer key-a")]),
            Some(ip("10.0.0.1")),
        )
        .unwrap();
    assert_eq!(who, Identity::ApiKey("tenant-a".into()));
}

#[test]
fn unknown_api_key_is_limited_by_address() {
    let id = identifier(&[]);
    let (who, kind) = id
        .identify(&headers(&[("x-api-key", "made-up")]), Some(ip("10.0.0.1")))
        .unwrap();
    assert_eq!(who, Identity::Ip(ip("10.0.0.1")));
    assert_eq!(kind, KeyKind::UnknownApiKey);
}

#[test]
fn malformed_api_keys_are_errors() {
    let id = identifier(&[]);
    let peer = Some(ip("10.0.0.1"));
    let long = "k".repeat(MAX_API_KEY_LEN + 1);
    assert_eq!(
        id.identify(&headers(&[("x-api-key", &long)]), peer),
        Err(IdentityError::ApiKeyTooLong)
    );
    assert_eq!(
        id.identify(&headers(&[("x-api-key", "")]), peer),
        Err(IdentityError::ApiKeyInvalid)
    );
    assert_eq!(
        id.identify(&headers(&[("x-api-key", "has space")]), peer),
        Err(IdentityError::ApiKeyInvalid)
    );
    let mut h = HeaderMap::new();
    h.insert(
        "x-api-key",
        HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
    );
    assert_eq!(id.identify(&h, peer), Err(IdentityError::ApiKeyInvalid));
    assert_eq!(
        id.identify(
            &headers(&[("x-api-key", "key-a"), ("x-api-key", "key-b")]),
            peer
        ),
        Err(IdentityError::ApiKeyConflict)
    );
    assert_eq!(
        id.identify(
            &headers(&[("x-api-key", "key-a"), ("authorization", "Bearer key-b")]),
            peer
        ),
        Err(IdentityError::ApiKeyConflict)
    );
    // The same key twice is not a conflict; Basic auth is not an API key.
    assert!(
        id.identify(
            &headers(&[("x-api-key", "key-a"), ("authorization", "bearer key-a")]),
            peer
        )
        .is_ok()
    );
    assert_eq!(
        id.identify(&headers(&[("authorization", "Basic dXNlcjpwYXNz")]), peer)
            .unwrap()
            .1,
        KeyKind::Ip
    );
}

#[test]
fn forwarded_for_is_ignored_from_untrusted_peers() {
    let id = identifier(&["10.0.0.0/8"]);
    let h = headers(&[("x-forwarded-for", "1.2.3.4")]);
    assert_eq!(
        id.client_ip(&h, ip("203.0.113.9")).unwrap(),
        ip("203.0.113.9")
    );
    // Not even parsed: garbage from an untrusted peer is not our problem.
    let h = headers(&[("x-forwarded-for", "not an address")]);
    assert_eq!(
        id.client_ip(&h, ip("203.0.113.9")).unwrap(),
        ip("203.0.113.9")
    );
}

#[test]
fn forwarding_from_an_untrusted_peer_is_what_is_signalled() {
    let id = identifier(&["10.0.0.0/8"]);
    let forwarded = headers(&[("x-forwarded-for", "1.2.3.4")]);
    assert!(id.ignores_forwarding(&forwarded, Some(ip("203.0.113.9"))));
    // An IPv4-mapped proxy address is the proxy.
    assert!(!id.ignores_forwarding(&forwarded, Some(ip("::ffff:10.1.2.3"))));
    assert!(!id.ignores_forwarding(&forwarded, Some(ip("10.1.2.3"))));
    assert!(!id.ignores_forwarding(&HeaderMap::new(), Some(ip("203.0.113.9"))));
    assert!(!id.ignores_forwarding(&forwarded, None));
    // Signalled even when the request's key is refused, and among other
    // headers, in any order.
    let h = headers(&[
        ("accept", "*/*"),
        ("x-api-key", "has space"),
        ("x-forwarded-for", "1.2.3.4"),
        ("x-request-id", "abc"),
    ]);
    let (identified, ignored) = id.identify_request(&h, Some(ip("203.0.113.9")));
    assert_eq!(identified, Err(IdentityError::ApiKeyInvalid));
    assert!(ignored);
}

/// Two different keys and a malformed one: the malformed key is named,
/// whichever header comes first; the request is refused either way.
#[test]
fn a_malformed_key_is_named_over_a_conflict_in_any_order() {
    let id = identifier(&[]);
    let peer = Some(ip("10.0.0.1"));
    let lines = [
        ("x-api-key", "key-a"),
        ("authorization", "Bearer key-b"),
        ("x-api-key", "has space"),
    ];
    for order in [[0, 1, 2], [2, 0, 1], [1, 2, 0], [1, 0, 2]] {
        let h = headers(&order.map(|i| lines[i]));
        assert_eq!(
            id.identify(&h, peer),
            Err(IdentityError::ApiKeyInvalid),
            "{order:?}"
        );
    }
}

#[test]
fn rightmost_untrusted_forwarded_for_entry_is_the_client() {
    let id = identifier(&["10.0.0.0/8", "127.0.0.1/32"]);
    // client 198.51.100.7 spoofs 1.1.1.1, then goes through 10.0.0.2 to 127.0.0.1.
    let h = headers(&[("x-forwarded-for", "1.1.1.1, 198.51.100.7, 10.0.0.2")]);
    assert_eq!(
        id.client_ip(&h, ip("127.0.0.1")).unwrap(),
        ip("198.51.100.7")
    );
    // Split across header lines, with ports and IPv6 brackets.
    let h = headers(&[
        ("x-forwarded-for", "1.1.1.1"),
        ("x-forwarded-for", "[2001:db8::1]:443, 10.0.0.2:80"),
    ]);
    assert_eq!(
        id.client_ip(&h, ip("127.0.0.1")).unwrap(),
        ip("2001:db8::1")
    );
    // All hops trusted: the left-most is the furthest known.
    let h = headers(&[("x-forwarded-for", "10.1.1.1, 10.0.0.2")]);
    assert_eq!(id.client_ip(&h, ip("127.0.0.1")).unwrap(), ip("10.1.1.1"));
    // No header from a trusted proxy: the proxy itself.
    assert_eq!(
        id.client_ip(&HeaderMap::new(), ip("127.0.0.1")).unwrap(),
        ip("127.0.0.1")
    );
    // IPv4-mapped IPv6 peers count as their IPv4 address.
    assert_eq!(
        id.client_ip(
            &headers(&[("x-forwarded-for", "198.51.100.7")]),
            ip("::ffff:127.0.0.1")
        )
        .unwrap(),
        ip("198.51.100.7")
    );
}

#[test]
fn malformed_forwarded_for_from_trusted_proxy_is_an_error() {
    let id = identifier(&["127.0.0.1/32"]);
    let peer = ip("127.0.0.1");
    assert_eq!(
        id.client_ip(&headers(&[("x-forwarded-for", "1.2.3.4, bogus")]), peer),
        Err(IdentityError::ForwardedForInvalid)
    );
    assert_eq!(
        id.client_ip(&headers(&[("x-forwarded-for", "1.2.3.4,,5.6.7.8")]), peer),
        Err(IdentityError::ForwardedForInvalid)
    );
    let many = vec!["1.2.3.4"; MAX_FORWARDED_FOR_HOPS + 1].join(",");
    assert_eq!(
        id.client_ip(&headers(&[("x-forwarded-for", &many)]), peer),
        Err(IdentityError::ForwardedForTooLong)
    );
    let long = format!("1.2.3.4{}", " ".repeat(MAX_FORWARDED_FOR_LEN));
    assert_eq!(
        id.client_ip(&headers(&[("x-forwarded-for", &long)]), peer),
        Err(IdentityError::ForwardedForTooLong)
    );
}

#[test]
fn ipv6_clients_are_keyed_by_prefix() {
    let id = identifier(&[]);
    let a = id
        .identify(&HeaderMap::new(), Some(ip("2001:db8:1:2::a")))
        .unwrap()
        .0;
    let b = id
        .identify(&HeaderMap::new(), Some(ip("2001:db8:1:2:ffff::b")))
        .unwrap()
        .0;
    let c = id
        .identify(&HeaderMap::new(), Some(ip("2001:db8:1:3::a")))
        .unwrap()
        .0;
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(a, Identity::Ip(ip("2001:db8:1:2::")));
}

#[test]
fn no_peer_address_is_reported() {
    assert_eq!(
        identifier(&[]).identify(&HeaderMap::new(), None),
        Err(IdentityError::NoPeerAddress)
    );
}

#[test]
fn bucket_keys_separate_policies_identities_and_secrets() {
    let h = KeyHasher::new([1; 16]);
    let alice = Identity::ApiKey("alice".into());
    let k = h.bucket_key("api", &alice);
    assert_eq!(k, h.bucket_key("api", &alice));
    assert_ne!(k, h.bucket_key("api2", &alice));
    assert_ne!(k, h.bucket_key("api", &Identity::ApiKey("bob".into())));
    assert_ne!(k, KeyHasher::new([2; 16]).bucket_key("api", &alice));
    // Field boundaries matter.
    assert_ne!(
        h.bucket_key("ab", &Identity::ApiKey("c".into())),
        h.bucket_key("a", &Identity::ApiKey("bc".into()))
    );
    // The key's text holds no trace of the identity.
    assert!(!format!("{k}").contains("alice"));
}

proptest! {
    /// No header value, however malformed, panics; an untrusted peer always
    /// stays the identity whatever X-Forwarded-For says.
    #[test]
    fn arbitrary_headers_never_panic_or_move_an_untrusted_peer(
        xff in prop::collection::vec(any::<u8>(), 0..300),
        key in prop::collection::vec(any::<u8>(), 0..300),
        auth in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let id = identifier(&["127.0.0.1/32"]);
        let mut h = HeaderMap::new();
        for (name, bytes) in [("x-forwarded-for", &xff), ("x-api-key", &key), ("authorization", &auth)] {
            if let Ok(v) = HeaderValue::from_bytes(bytes) {
                h.insert(name, v);
            }
        }
        let _ = id.identify(&h, Some(ip("127.0.0.1")));
        if let Ok((who, kind)) = id.identify(&h, Some(ip("203.0.113.1")))
            && kind != KeyKind::ApiKey
        {
            prop_assert_eq!(who, Identity::Ip(ip("203.0.113.1")));
        }
    }
}

/// Structured requests, as proxies and clients really send them, for the
/// property below: address lists with trusted and untrusted hops (IPv4,
/// IPv6, mapped IPv4, with and without ports, over several header lines),
/// and API keys of every kind in either header.
mod structured {
    use super::*;

    /// The trusted ranges of the identifier under test.
    const TRUSTED: [&str; 3] = ["10.0.0.0/8", "127.0.0.1/32", "2001:db8:ffff::/48"];

    fn trusted(ip: IpAddr) -> bool {
        TRUSTED
            .iter()
            .any(|n| n.parse::<IpNet>().unwrap().contains(&ip.to_canonical()))
    }

    /// An address (trusted or not, of each family), and how it is written.
    fn hop() -> impl Strategy<Value = (IpAddr, String)> {
        let v4 = prop_oneof![
            any::<[u8; 3]>().prop_map(|[a, b, c]| IpAddr::from([10, a, b, c])),
            Just(ip("127.0.0.1")),
            any::<[u8; 4]>().prop_map(IpAddr::from),
        ];
        let v6 = prop_oneof![
            any::<u128>().prop_map(|low| IpAddr::V6(Ipv6Addr::from(
                (0x2001_0db8_ffff_u128 << 80) | (low >> 48)
            ))),
            any::<u128>().prop_map(|bits| IpAddr::V6(Ipv6Addr::from(bits))),
        ];
        prop_oneof![
            (v4.clone(), any::<bool>(), any::<u16>()).prop_map(|(ip, port, p)| {
                let text = if port {
                    format!("{ip}:{p}")
                } else {
                    ip.to_string()
                };
                (ip, text)
            }),
            // A mapped IPv4 is its IPv4 address (and trusted as such).
            (v4, any::<bool>(), any::<u16>()).prop_map(|(ip, port, p)| {
                let IpAddr::V4(v4) = ip else { unreachable!() };
                let mapped = v4.to_ipv6_mapped();
                let text = if port {
                    format!("[{mapped}]:{p}")
                } else {
                    mapped.to_string()
                };
                (ip, text)
            }),
            (v6, any::<bool>(), any::<u16>()).prop_map(|(ip, port, p)| {
                let text = if port {
                    format!("[{ip}]:{p}")
                } else {
                    ip.to_string()
                };
                (ip.to_canonical(), text)
            }),
        ]
    }

    /// What an `X-Forwarded-For` list holds besides addresses.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Junk {
        None,
        /// An entry that is not an address.
        Garbage,
        /// An empty entry (`a,,b`).
        Empty,
    }

    /// Hops, the header lines they are split into (with spacing), and junk.
    fn forwarded() -> impl Strategy<Value = (Vec<(IpAddr, String)>, Vec<String>, Junk)> {
        (
            prop::collection::vec(hop(), 0..40),
            1usize..=3,
            prop_oneof![8 => Just(Junk::None), 1 => Just(Junk::Garbage), 1 => Just(Junk::Empty)],
            any::<prop::sample::Index>(),
            prop::sample::select(vec![",", ", ", " , ", ",\t"]),
        )
            .prop_map(|(hops, lines, junk, at, sep)| {
                let mut entries: Vec<String> = hops.iter().map(|(_, t)| t.clone()).collect();
                match junk {
                    Junk::None => {}
                    Junk::Garbage => entries.insert(at.index(entries.len() + 1), "unknown".into()),
                    Junk::Empty => entries.insert(at.index(entries.len() + 1), String::new()),
                }
                let per_line = entries.len().div_ceil(lines).max(1);
                let text: Vec<String> = entries.chunks(per_line).map(|c| c.join(sep)).collect();
                (hops, text, junk)
            })
    }

    /// An API key as presented: its header and value, and what it is.
    #[derive(Debug, Clone, PartialEq)]
    enum Key {
        /// The configured key (tenant-a's).
        Configured,
        /// A well-formed key nobody configured, of a length around the limit.
        Unknown(String),
        /// Too long by `n` bytes.
        TooLong(usize),
        /// Empty, or with a character outside visible ASCII.
        Invalid(String),
    }

    fn key() -> impl Strategy<Value = Key> {
        prop_oneof![
            3 => Just(Key::Configured),
            3 => prop_oneof![1usize..=8, 248usize..=256]
                .prop_map(|n| Key::Unknown("k".repeat(n))),
            1 => (1usize..=3).prop_map(Key::TooLong),
            1 => prop::sample::select(vec!["", "key a", "kéy"])
                .prop_map(|s| Key::Invalid(s.to_owned())),
        ]
    }

    impl Key {
        fn text(&self) -> String {
            match self {
                Key::Configured => "key-a".into(),
                Key::Unknown(k) | Key::Invalid(k) => k.clone(),
                Key::TooLong(n) => "x".repeat(MAX_API_KEY_LEN + n),
            }
        }
    }

    /// Keys in `X-Api-Key` lines and `Authorization: Bearer` lines.
    fn keys() -> impl Strategy<Value = (Vec<Key>, Vec<Key>)> {
        (
            prop::collection::vec(key(), 0..=2),
            prop::collection::vec(key(), 0..=2),
        )
    }

    fn peer() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            Just(ip("127.0.0.1")),
            Just(ip("::ffff:127.0.0.1")),
            Just(ip("10.9.8.7")),
            Just(ip("2001:db8:ffff::1")),
            Just(ip("203.0.113.1")),
            Just(ip("2001:db8:1::1")),
        ]
    }

    fn masked(ip: IpAddr) -> IpAddr {
        match ip.to_canonical() {
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
            v4 => v4,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// From any peer, trusted or not: a verified key only when the
        /// configured key was presented (and no other); an unknown key
        /// only ever widens nothing (it is limited by address); the address
        /// is the peer unless the peer is a trusted proxy, and then the
        /// right-most hop that is not itself trusted (or the left-most when
        /// all are); a list that cannot be read exactly is an error, never
        /// a guess.
        #[test]
        fn structured_requests_are_identified_as_the_rules_say(
            peer in peer(),
            (hops, lines, junk) in forwarded(),
            (api_keys, bearers) in keys(),
        ) {
            let id = Identifier::new(
                ApiKeys::from_digests([("tenant-a".to_owned(), ApiKeys::digest("key-a"))]),
                TRUSTED.iter().map(|n| n.parse().unwrap()).collect(),
                64,
            );
            let mut h = HeaderMap::new();
            for line in &lines {
                h.append("x-forwarded-for", HeaderValue::from_str(line).unwrap());
            }
            for k in &api_keys {
                h.append("x-api-key", HeaderValue::from_bytes(k.text().as_bytes()).unwrap());
            }
            for k in &bearers {
                h.append(
                    http::header::AUTHORIZATION,
                    HeaderValue::from_bytes(format!("Bearer {}", k.text()).as_bytes()).unwrap(),
                );
            }
            // `Authorization: Bearer ` with nothing after it carries no key
            // (the request stays anonymous, limited by address).
            let empty = Key::Invalid(String::new());
            let presented: Vec<&Key> = api_keys
                .iter()
                .chain(bearers.iter().filter(|k| **k != empty))
                .collect();
            let malformed = presented.iter().any(|k| matches!(k, Key::TooLong(_) | Key::Invalid(_)));
            let distinct: std::collections::BTreeSet<String> =
                presented.iter().map(|k| k.text()).collect();
            let result = id.identify(&h, Some(peer));

            // The API key.
            if malformed || distinct.len() > 1 {
                prop_assert!(
                    matches!(
                        result,
                        Err(IdentityError::ApiKeyTooLong | IdentityError::ApiKeyInvalid | IdentityError::ApiKeyConflict)
                    ),
                    "{:?} from {:?}", result, presented
                );
                return Ok(());
            }
            let configured = presented.first().is_some_and(|k| **k == Key::Configured);
            if configured {
                prop_assert_eq!(result, Ok((Identity::ApiKey("tenant-a".into()), KeyKind::ApiKey)));
                return Ok(());
            }
            let kind = if presented.is_empty() { KeyKind::Ip } else { KeyKind::UnknownApiKey };

            // The address.
            let peer_c = peer.to_canonical();
            if !trusted(peer_c) {
                prop_assert_eq!(result, Ok((Identity::Ip(masked(peer_c)), kind)));
                return Ok(());
            }
            let bytes: usize = lines.iter().map(String::len).sum();
            let too_long = bytes > MAX_FORWARDED_FOR_LEN
                || hops.len() + usize::from(junk != Junk::None) > MAX_FORWARDED_FOR_HOPS;
            if junk != Junk::None || too_long {
                prop_assert!(
                    matches!(
                        result,
                        Err(IdentityError::ForwardedForInvalid | IdentityError::ForwardedForTooLong)
                    ),
                    "{:?} from {:?}", result, lines
                );
                if junk == Junk::None {
                    prop_assert_eq!(result, Err(IdentityError::ForwardedForTooLong));
                }
                return Ok(());
            }
            let client = hops
                .iter()
                .rev()
                .map(|(ip, _)| *ip)
                .find(|ip| !trusted(*ip))
                .or_else(|| hops.first().map(|(ip, _)| *ip))
                .unwrap_or(peer_c);
            prop_assert_eq!(result, Ok((Identity::Ip(masked(client)), kind)), "{:?}", lines);
        }
    }
}

/// The per-address connection cap counts a host as the limiter keys it:
/// an IPv6 host by its /64, an IPv4-mapped address as the IPv4 one, and a
/// trusted proxy not at all.
#[test]
fn connections_are_owned_as_clients_are_keyed() {
    let id = identifier(&["10.0.0.0/24"]);
    assert_eq!(id.connection_owner(ip("192.0.2.7")), Some(ip("192.0.2.7")));
    assert_eq!(
        id.connection_owner(ip("::ffff:192.0.2.7")),
        Some(ip("192.0.2.7"))
    );
    assert_eq!(
        id.connection_owner(ip("2001:db8:0:1:abcd::9")),
        Some(ip("2001:db8:0:1::"))
    );
    assert_eq!(id.connection_owner(ip("10.0.0.9")), None, "a trusted proxy");
    assert_eq!(id.connection_owner(ip("::ffff:10.0.0.9")), None);
}
