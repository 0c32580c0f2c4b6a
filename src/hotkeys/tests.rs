use super::space_saving::SpaceSaving;
use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

/// A skewed stream: a few heavy keys among many light ones.
fn stream() -> impl Strategy<Value = (usize, Vec<(u8, u64)>)> {
    (
        1usize..16,
        prop::collection::vec(
            (
                prop_oneof![3 => 0u8..4, 1 => any::<u8>()],
                prop_oneof![4 => Just(1u64), 1 => 1u64..20],
            ),
            0..600,
        ),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The paper's guarantees: bounds around the true weight, every key
    /// heavier than N / capacity tracked, and the counts add up to N.
    #[test]
    fn space_saving_keeps_its_guarantees((capacity, items) in stream()) {
        let mut summary = SpaceSaving::<u8, ()>::new(capacity);
        let mut truth: HashMap<u8, u64> = HashMap::new();
        for &(key, weight) in &items {
            summary.offer(key, weight, || ());
            *truth.entry(key).or_default() += weight;
        }
        let n: u64 = truth.values().sum();
        prop_assert_eq!(summary.total(), n);
        let tracked = summary.top(capacity);
        prop_assert!(tracked.len() <= capacity);
        if truth.len() >= capacity {
            prop_assert_eq!(tracked.iter().map(|e| e.count).sum::<u64>(), n);
        }
        for e in &tracked {
            let real = truth[&e.key];
            prop_assert!(e.guaranteed() <= real, "{:?}: guaranteed above {}", e, real);
            prop_assert!(real <= e.count, "{:?}: true {} above count", e, real);
        }
        for (key, &real) in &truth {
            if real * capacity as u64 > n {
                prop_assert!(summary.get(key).is_some(), "{} ({} of {}) not tracked", key, real, n);
            }
        }
        // Sorted by what is certain, heaviest first.
        for pair in tracked.windows(2) {
            prop_assert!(pair[0].guaranteed() >= pair[1].guaranteed());
        }
    }
}

const SECOND: Micros = 1_000_000;
const T0: Micros = 1_800_000_000 * SECOND;

/// Settings with a 10 s window.
fn settings(tracked: usize, top: usize, addresses: AddressDisplay) -> HotKeySettings {
    HotKeySettings {
        tracked,
        top,
        window: Duration::from_secs(10),
        addresses,
    }
}

fn detector(tracked: usize, top: usize, addresses: AddressDisplay) -> HotKeys {
    HotKeys::new(settings(tracked, top, addresses)).unwrap()
}

fn tenant(name: &str) -> Identity {
    Identity::ApiKey(Arc::from(name))
}

/// Two nodes: slots below 8192 on "a", the rest on "b".
fn two_nodes(slot: u16) -> Option<Arc<str>> {
    Some(Arc::from(if slot < 8192 { "a:1" } else { "b:2" }))
}

/// A bucket key whose slot is on node "a" (or "b").
fn key_on(node_a: bool, nth: u128) -> BucketKey {
    (0..)
        .map(|i| BucketKey(nth * 1_000_003 + i))
        .find(|k| (k.slot() < 8192) == node_a)
        .unwrap()
}

#[test]
fn no_tracking_no_detector() {
    assert!(
        HotKeys::new(HotKeySettings {
            tracked: 0,
            top: 0,
            window: Duration::from_secs(10),
            addresses: AddressDisplay::Show,
        })
        .is_none()
    );
}

#[test]
fn the_last_complete_window_names_the_hot_key_its_node_and_share() {
    let hot = detector(8, 3, AddressDisplay::Show);
    let policy: Arc<str> = Arc::from("api");
    let heavy = key_on(true, 1);
    let light = key_on(true, 2);
    let elsewhere = key_on(false, 3);
    // One window of 10 s: heavy 900 checks (800 reached Redis), light 100,
    // a key on the other node 500.
    for i in 0..1500u64 {
        let now = T0 + i * (10 * SECOND / 1500);
        let (key, who) = match i % 15 {
            0 => (light, "light"),
            1..=5 => (elsewhere, "elsewhere"),
            _ => (heavy, "heavy"),
        };
        let store_call = !(key == heavy && i % 9 == 0);
        hot.record(now, key, &policy, KeyKind::ApiKey, &tenant(who), store_call);
    }
    // Still inside the first window: nothing complete to show.
    assert!(hot.top(T0 + 9 * SECOND, &two_nodes).is_empty());
    let top = hot.top(T0 + 10 * SECOND, &two_nodes);
    let names: Vec<&str> = top.iter().map(|k| k.display.as_str()).collect();
    assert_eq!(names, ["heavy", "elsewhere", "light"]);
    let heavy_stats = &top[0];
    assert_eq!(heavy_stats.node.as_ref(), "a:1");
    assert_eq!(heavy_stats.kind, KeyKind::ApiKey);
    assert!((heavy_stats.checks_per_second - 90.0).abs() < 1e-9);
    let heavy_calls = (0..1500u64).filter(|i| i % 15 > 5 && i % 9 != 0).count() as f64;
    assert!((heavy_stats.store_calls_per_second - heavy_calls / 10.0).abs() < 1e-9);
    // Its share of node a's calls: the light key's 100 are the rest.
    let share = heavy_calls / (heavy_calls + 100.0);
    assert!(
        (heavy_stats.node_share - share).abs() < 1e-9,
        "{}",
        heavy_stats.node_share
    );
    // Alone on node b: all of it.
    assert_eq!(top[1].node.as_ref(), "b:2");
    assert!((top[1].node_share - 1.0).abs() < 1e-9);
}

#[test]
fn on_one_node_a_share_is_of_all_the_stores_calls() {
    // The in-process store: no slots, every key on "memory". The one-node
    // detector must report what a slotted one does for a store whose
    // slot owner is always `None`, without counting by slot.
    let slotted = detector(8, 3, AddressDisplay::Show);
    let one = HotKeys::on_one_node(settings(8, 3, AddressDisplay::Show)).unwrap();
    let policy: Arc<str> = Arc::from("api");
    // Keys on both of `two_nodes`' halves: one node here all the same.
    let (a, b) = (key_on(true, 1), key_on(false, 2));
    for i in 0..300u64 {
        let now = T0 + i * (10 * SECOND / 300);
        let (key, who) = if i % 3 == 0 { (b, "b") } else { (a, "a") };
        for hot in [&slotted, &one] {
            hot.record(now, key, &policy, KeyKind::ApiKey, &tenant(who), i % 5 != 0);
        }
    }
    let none = |_: u16| None;
    let top = one.top(T0 + 10 * SECOND, &none);
    assert_eq!(top, slotted.top(T0 + 10 * SECOND, &none));
    assert_eq!(top[0].node.as_ref(), "memory");
    let calls = (0..300u64).filter(|i| i % 5 != 0).count() as f64;
    let a_calls = (0..300u64).filter(|i| i % 3 != 0 && i % 5 != 0).count() as f64;
    assert!((top[0].node_share - a_calls / calls).abs() < 1e-9);
    assert!((top[0].node_share + top[1].node_share - 1.0).abs() < 1e-9);
}

#[test]
fn a_key_that_cooled_down_leaves_after_one_window() {
    let hot = detector(8, 3, AddressDisplay::Show);
    let policy: Arc<str> = Arc::from("api");
    let key = key_on(true, 1);
    for i in 0..100 {
        hot.record(
            T0 + i * 1000,
            key,
            &policy,
            KeyKind::ApiKey,
            &tenant("t"),
            true,
        );
    }
    assert_eq!(hot.top(T0 + 10 * SECOND, &two_nodes).len(), 1);
    assert_eq!(hot.top(T0 + 19 * SECOND, &two_nodes).len(), 1);
    // The window [10 s, 20 s) had no checks.
    assert!(hot.top(T0 + 20 * SECOND, &two_nodes).is_empty());
    // Nor did a much later one, even if recording resumes there.
    hot.record(
        T0 + 55 * SECOND,
        key,
        &policy,
        KeyKind::ApiKey,
        &tenant("t"),
        true,
    );
    assert!(hot.top(T0 + 55 * SECOND, &two_nodes).is_empty());
    assert_eq!(hot.top(T0 + 60 * SECOND, &two_nodes).len(), 1);
}

#[test]
fn addresses_show_or_hash_and_tenants_always_show() {
    let policy: Arc<str> = Arc::from("anon");
    let ip = Identity::Ip("203.0.113.7".parse().unwrap());
    let key = BucketKey(0x1234_5678_9abc_def0_0000_0000_0000_0001);
    for (mode, want) in [
        (AddressDisplay::Show, "203.0.113.7"),
        (AddressDisplay::Hash, "h:12345678"),
    ] {
        let hot = detector(4, 2, mode);
        hot.record(T0, key, &policy, KeyKind::Ip, &ip, true);
        hot.record(
            T0 + 1,
            BucketKey(7),
            &policy,
            KeyKind::ApiKey,
            &tenant("acme"),
            true,
        );
        let top = hot.top(T0 + 10 * SECOND, &|_| None);
        let names: Vec<&str> = top.iter().map(|k| k.display.as_str()).collect();
        assert!(names.contains(&want), "{names:?}");
        assert!(names.contains(&"acme"), "{names:?}");
        assert!(top.iter().all(|k| k.node.as_ref() == "memory"));
    }
}

#[test]
fn a_shown_descriptor_keeps_the_start_of_a_long_value() {
    let policy: Arc<str> = Arc::from("per-api-key");
    let long = "é".repeat(5_000);
    let descriptor = crate::descriptors::DescriptorId {
        domain: "demo".into(),
        entries: vec![("api_key".into(), long.as_str().into())].into(),
    };
    let identity = Identity::Descriptor(Arc::new(descriptor));
    let hot = detector(4, 2, AddressDisplay::Show);
    hot.record(
        T0,
        BucketKey(9),
        &policy,
        KeyKind::Descriptor,
        &identity,
        true,
    );
    let top = hot.top(T0 + 10 * SECOND, &|_| None);
    let shown = &top[0].display;
    assert!(shown.starts_with("demo api_key=éé"), "{shown}");
    assert!(shown.ends_with('…'), "{shown}");
    assert!(shown.len() <= MAX_SHOWN + '…'.len_utf8(), "{}", shown.len());
}

#[test]
fn only_the_top_n_are_exported_and_rendered_as_gauges() {
    let hot = detector(16, 2, AddressDisplay::Show);
    let policy: Arc<str> = Arc::from("api");
    for k in 0..10u64 {
        for _ in 0..=k {
            hot.record(
                T0 + k,
                BucketKey(u128::from(k)),
                &policy,
                KeyKind::ApiKey,
                &tenant(&format!("t{k}\"q")),
                true,
            );
        }
    }
    let text = hot.render(T0 + 10 * SECOND, &|_| Some(Arc::from("n:1")));
    let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(samples.len(), 6, "{text}");
    for name in [
        m::HOT_KEY_CHECKS_PER_SECOND,
        m::HOT_KEY_STORE_CALLS_PER_SECOND,
        m::HOT_KEY_NODE_SHARE,
    ] {
        assert!(text.contains(&format!("# TYPE {name} gauge")), "{text}");
    }
    let slot = BucketKey(9).slot();
    assert!(
        text.contains(&format!(
            "ratelimit_hot_key_checks_per_second{{policy=\"api\",key_kind=\"api_key\",key=\"t9\\\"q\",slot=\"{slot}\",node=\"n:1\"}} 1\n"
        )),
        "{text}"
    );
    assert!(!text.contains("t7"), "only the top 2: {text}");
}
