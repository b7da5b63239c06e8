//! Held messages and ownership, over a real nats-server and real HTTP on both backends: anonymous
//! broker messages held for an unowned aggregate never write it once an operator gave it an owner
//! (the transfer rejects them, and so does any drain), a held message whose sequence another
//! message took is rejected as stale, and the rejected list that shows them is kept in the
//! inbox's store: paged, and still there after a restart. A producer's early messages are held
//! too, in its namespace under the epoch they were sent under: they drain in order as that
//! producer, by its own delivery or an operator's gap skip, and one whose producer was revoked or
//! fenced meanwhile is refused and listed, never applied.

use std::time::Duration;

use async_nats::jetstream;
use lab_testkit::nats::NatsServer;
use production_lab::broker::wire;
use serde_json::{Value, json};

use crate::aggregates::{add_operator, resolve, resolve_at, skip};
use crate::broker::{
    jetstream_of, publish_acked, publish_ordered, quick_redelivery, spawn_consumer_on, start_nats,
};
use crate::helpers::{
    Backend, TestApp, assert_bad_request, poll_until, spawn_app_on_with, status_and_json,
};
use crate::producers::{add_producer, epoch, producer_command};

/// A private nats-server and a server consuming it, with its inbox on `backend`.
async fn consumer_on(backend: Backend) -> (NatsServer, TestApp, jetstream::Context) {
    let nats = start_nats(None);
    let app = spawn_consumer_on(&nats, backend).await;
    let js = jetstream_of(&nats).await;
    (nats, app, js)
}

/// Publishes one anonymous message (`Nats-Msg-Id` its id) and waits for its PubAck.
async fn publish(js: &jetstream::Context, aggregate: &str, id: &str, sequence: i64, amount: i64) {
    publish_ordered(js, None, aggregate, id, sequence, amount).await;
}

async fn get(app: &TestApp, path: &str) -> (u16, Value) {
    status_and_json(app.get(path).await).await
}

/// Waits until the aggregate holds exactly `sequences`.
async fn holding(app: &TestApp, aggregate: &str, sequences: Value) -> Value {
    let path = format!("/aggregates/{aggregate}");
    poll_until(
        &format!("{aggregate} holds {sequences}"),
        || get(app, &path),
        |(status, view)| *status == 200 && view["heldSequences"] == sequences,
    )
    .await
    .1
}

/// Quarantines the poison `bad-1` at sequence 1 of `acct`, then publishes an anonymous `x-N` at
/// each sequence of `held`; waits until `acct` holds them and answers its view.
async fn blocked_holding(app: &TestApp, js: &jetstream::Context, held: &[i64]) -> Value {
    publish(js, "acct", "bad-1", 1, -1).await;
    for sequence in held {
        publish(js, "acct", &format!("x-{sequence}"), *sequence, 100).await;
    }
    holding(app, "acct", json!(held)).await
}

/// `POST /aggregates/{aggregate}/owner` by the operator, from unowned at last `expected_last`.
async fn transfer_to(
    app: &TestApp,
    operator: &str,
    aggregate: &str,
    producer: &str,
    expected_last: i64,
) -> Value {
    let body = json!({
        "producer": producer,
        "expectedOwner": null,
        "expectedLast": expected_last,
        "reason": "the billing service owns this account now",
    });
    let response = app
        .client
        .post(app.url(&format!("/aggregates/{aggregate}/owner")))
        .bearer_auth(operator)
        .json(&body)
        .send()
        .await
        .expect("POST reaches the server");
    let (status, answer) = status_and_json(response).await;
    assert_eq!(status, 200, "{answer}");
    answer
}

/// A general-door delivery of amount 1 by the producer holding `token` under `epoch`.
async fn deliver_as(
    app: &TestApp,
    (token, epoch): (&str, i64),
    aggregate: &str,
    id: &str,
    sequence: i64,
) -> (u16, Value) {
    let response = app
        .client
        .post(app.url(&format!("/aggregates/{aggregate}/messages")))
        .bearer_auth(token)
        .header("producer-epoch", epoch.to_string())
        .json(&json!({"messageId": id, "sequence": sequence, "amount": 1}))
        .send()
        .await
        .expect("POST reaches the server");
    status_and_json(response).await
}

fn applied_by(app: &TestApp, aggregate: &str) -> Vec<String> {
    app.inbox_rows(&format!(
        "SELECT message_id, producer FROM ordered_inbox WHERE aggregate_id = '{aggregate}' ORDER BY sequence"
    ))
}

/// Every entry of `GET /broker/rejected`, following its cursor.
async fn rejected_list(app: &TestApp) -> Vec<Value> {
    let mut entries = Vec::new();
    let mut after = 0;
    loop {
        let (status, page) = get(app, &format!("/broker/rejected?after={after}")).await;
        assert_eq!(status, 200, "{page}");
        entries.extend(page["rejected"].as_array().cloned().unwrap_or_default());
        match page["next"].as_i64() {
            Some(next) => after = next,
            None => return entries,
        }
    }
}

/// Registers the operator alice and the producer billing and starts billing's session: alice's
/// token, and billing's token and epoch.
async fn alice_and_billing(app: &TestApp) -> (String, String, i64) {
    let operator = add_operator(app, "alice");
    let billing = add_producer(app, "billing");
    let billing_epoch = epoch(app, &billing).await;
    (operator, billing, billing_epoch)
}

/// Skips the dead letter `id` as `operator` from last 0; the skip must be answered 200.
async fn skip_from_zero(app: &TestApp, operator: &str, id: &str) {
    let (status, body) = resolve(app, Some(operator), id, &skip(0, "cancelled upstream")).await;
    assert_eq!(status, 200, "{body}");
}

/// The rejected list's (message id, outcome) of messages refused because their aggregate has
/// an owner now.
fn owner_required(ids: &[&str]) -> Vec<(String, String)> {
    ids.iter()
        .map(|id| ((*id).to_owned(), "owner required".to_owned()))
        .collect()
}

/// The (message id, outcome) of every entry of the rejected list.
fn outcomes(entries: &[Value]) -> Vec<(String, String)> {
    entries
        .iter()
        .map(|entry| {
            (
                entry["messageId"].as_str().unwrap_or("").to_owned(),
                entry["outcome"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// The message ids of the aggregate's `held rejected` events, oldest first.
async fn held_rejected_events(app: &TestApp, aggregate: &str) -> Vec<String> {
    let (_, timeline) = get(app, &format!("/aggregates/{aggregate}/timeline")).await;
    timeline["events"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|event| event["kind"] == "held rejected")
        .map(|event| event["messageId"].as_str().unwrap_or("").to_owned())
        .collect()
}

async fn a_transfer_rejects_held_anonymous_messages_so_the_owners_own_sequence_applies(
    backend: Backend,
) {
    let (_nats, app, js) = consumer_on(backend).await;
    publish(&js, "acct", "x-2", 2, 100).await;
    publish(&js, "acct", "x-3", 3, 100).await;
    holding(&app, "acct", json!([2, 3])).await;

    let (operator, billing, billing_epoch) = alice_and_billing(&app).await;
    let billing = (billing.as_str(), billing_epoch);
    let answer = transfer_to(&app, &operator, "acct", "billing", 0).await;
    assert_eq!(answer["outcome"], "owner transferred", "{answer}");
    assert_eq!(answer["transfer"]["heldRejected"], 2, "{answer}");
    assert_eq!(answer["transfer"]["toOwner"], "billing", "{answer}");

    let (status, first) = deliver_as(&app, billing, "acct", "m-1", 1).await;
    assert_eq!((status, first["total"].clone()), (200, json!(1)), "{first}");
    let (status, second) = deliver_as(&app, billing, "acct", "m-2", 2).await;
    assert_eq!(status, 200, "the owner's real 2 is not stale: {second}");
    assert_eq!(applied_by(&app, "acct"), ["m-1|billing", "m-2|billing"]);
    let view = holding(&app, "acct", json!([])).await;
    assert_eq!(
        (view["last"].clone(), view["total"].clone()),
        (json!(2), json!(2))
    );
    assert_eq!(held_rejected_events(&app, "acct").await, ["x-2", "x-3"]);

    let rejected = rejected_list(&app).await;
    assert_eq!(outcomes(&rejected), owner_required(&["x-2", "x-3"]));
    assert_eq!(rejected[0]["subject"], "ordered.acct", "{rejected:?}");
    assert_eq!(rejected[0]["aggregateId"], "acct", "{rejected:?}");
    app.stop().await;
}

async fn a_skip_after_a_transfer_drains_no_held_anonymous_message_into_the_owned_aggregate(
    backend: Backend,
) {
    let (_nats, app, js) = consumer_on(backend).await;
    let view = blocked_holding(&app, &js, &[2, 3]).await;
    assert_eq!(view["status"], "blocked", "{view}");

    let (operator, billing, billing_epoch) = alice_and_billing(&app).await;
    let billing = (billing.as_str(), billing_epoch);
    let answer = transfer_to(&app, &operator, "acct", "billing", 0).await;
    assert_eq!(answer["transfer"]["heldRejected"], 2, "{answer}");

    skip_from_zero(&app, &operator, "bad-1").await;
    let (_, view) = get(&app, "/aggregates/acct").await;
    assert_eq!(
        (
            view["last"].clone(),
            view["total"].clone(),
            view["status"].clone()
        ),
        (json!(1), json!(0), json!("flowing")),
        "the skip took sequence 1 and nothing drained: {view}"
    );
    let (status, second) = deliver_as(&app, billing, "acct", "m-2", 2).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(applied_by(&app, "acct"), ["m-2|billing"]);
    assert_eq!(
        outcomes(&rejected_list(&app).await),
        owner_required(&["x-2", "x-3"])
    );
    app.stop().await;
}

/// A held row an earlier release could leave behind on an owned aggregate (the transfer did not
/// reject it then): the next drain checks admission itself and rejects it.
async fn a_held_anonymous_message_left_on_an_owned_aggregate_is_rejected_by_the_next_drain(
    backend: Backend,
) {
    let (_nats, app, js) = consumer_on(backend).await;
    blocked_holding(&app, &js, &[2]).await;
    let (operator, ..) = alice_and_billing(&app).await;
    // The owner columns set as a transfer sets them, the held row left in place.
    app.inbox_execute(
        "UPDATE aggregate_state SET owner = 'billing', owner_epoch = 1, owner_since = 'then'
          WHERE aggregate_id = 'acct'",
    );
    skip_from_zero(&app, &operator, "bad-1").await;
    let view = holding(&app, "acct", json!([])).await;
    assert_eq!(
        (view["last"].clone(), view["total"].clone()),
        (json!(1), json!(0))
    );
    assert!(applied_by(&app, "acct").is_empty());
    assert_eq!(held_rejected_events(&app, "acct").await, ["x-2"]);
    assert_eq!(
        outcomes(&rejected_list(&app).await),
        owner_required(&["x-2"])
    );
    app.stop().await;
}

/// A held row whose sequence another message took (as earlier releases could leave one behind,
/// for ever): the next drain rejects it as stale.
async fn a_held_message_whose_sequence_another_message_took_is_rejected_as_stale_and_listed(
    backend: Backend,
) {
    let (_nats, app, js) = consumer_on(backend).await;
    publish(&js, "acct", "m-1", 1, 1).await;
    publish(&js, "acct", "m-2", 2, 1).await;
    poll_until(
        "acct at 2",
        || get(&app, "/aggregates/acct"),
        |(_, view)| view["last"] == 2,
    )
    .await;
    app.inbox_execute(
        "INSERT INTO held_messages(message_id, aggregate_id, sequence, payload, message_payload,
                                   held_at)
         VALUES ('late-2', 'acct', 2,
                 '{\"AggregateId\":\"acct\",\"Sequence\":2,\"Amount\":5}', '{\"Amount\":5}',
                 '2020-01-01T00:00:00.000Z')",
    );
    holding(&app, "acct", json!([2])).await;
    publish(&js, "acct", "m-3", 3, 1).await;
    let view = holding(&app, "acct", json!([])).await;
    assert_eq!(
        (view["last"].clone(), view["total"].clone()),
        (json!(3), json!(3))
    );
    assert_eq!(held_rejected_events(&app, "acct").await, ["late-2"]);
    let rejected = rejected_list(&app).await;
    assert_eq!(
        outcomes(&rejected),
        [("late-2".to_owned(), "stale".to_owned())]
    );
    assert!(
        rejected[0]["reason"]
            .as_str()
            .is_some_and(|reason| reason.contains("the aggregate expects 4")),
        "{rejected:?}"
    );
    app.stop().await;
}

async fn the_rejected_list_is_paged_and_survives_a_restart(backend: Backend) {
    let (nats, app, js) = consumer_on(backend).await;
    for n in 1..=3 {
        let id = format!("broken-{n}");
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(wire::MESSAGE_ID_HEADER, id.as_str());
        publish_acked(&js, "ordered.acct".to_owned(), headers, "{".to_owned()).await;
    }
    poll_until(
        "three malformed deliveries listed",
        || rejected_list(&app),
        |list| list.len() == 3,
    )
    .await;
    let (status, first) = get(&app, "/broker/rejected?limit=2").await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["kept"], 1000, "{first}");
    assert_eq!(
        first["rejected"].as_array().map(Vec::len),
        Some(2),
        "{first}"
    );
    let next = first["next"].as_i64().expect("a cursor to the next page");
    let (_, rest) = get(&app, &format!("/broker/rejected?after={next}&limit=2")).await;
    assert_eq!(rest["rejected"].as_array().map(Vec::len), Some(1), "{rest}");
    assert_eq!(rest["next"], Value::Null, "{rest}");
    for bad in ["after=-1", "after=soon", "limit=0", "limit=1001"] {
        assert_bad_request(app.get(&format!("/broker/rejected?{bad}")).await).await;
    }

    let (dir, mut config) = app.stop().await;
    config.nats = Some(quick_redelivery(&nats));
    let again = crate::helpers::start(dir, config).await;
    let listed = rejected_list(&again).await;
    assert_eq!(
        outcomes(&listed),
        ["broken-1", "broken-2", "broken-3"].map(|id| (id.to_owned(), "malformed".to_owned()))
    );
    assert!(
        listed
            .iter()
            .all(|entry| entry["subject"] == "ordered.acct" && entry["streamSequence"].is_u64()),
        "{listed:?}"
    );
    again.stop().await;
}

// A producer's early messages on the broker door.

/// A consumer whose nak'd messages would come back only after a minute: whatever applies within
/// a test's patience was held, not nak'd and redelivered.
async fn consumer_that_never_waits_for_a_nak(
    backend: Backend,
) -> (NatsServer, TestApp, jetstream::Context) {
    let nats = start_nats(None);
    let mut broker = quick_redelivery(&nats);
    broker.nak_delay = Duration::from_secs(60);
    let app = spawn_app_on_with(backend, move |config| config.nats = Some(broker)).await;
    let js = jetstream_of(&nats).await;
    (nats, app, js)
}

/// billing's token and epoch, as its broker messages carry them.
struct Billing {
    token: String,
    epoch: i64,
}

impl Billing {
    async fn start(app: &TestApp) -> Billing {
        let token = add_producer(app, "billing");
        let epoch = epoch(app, &token).await;
        Billing { token, epoch }
    }

    /// Publishes billing's `id` at `sequence` (amount = sequence) under `epoch`; a resend
    /// (`Resend-Msg-Id`) is stored by JetStream whatever its duplicate window saw.
    async fn publish(
        &self,
        js: &jetstream::Context,
        epoch: i64,
        (aggregate, id, sequence): (&str, &str, i64),
        resend: bool,
    ) {
        let mut headers = async_nats::HeaderMap::new();
        let header = match resend {
            true => wire::RESEND_HEADER,
            false => wire::MESSAGE_ID_HEADER,
        };
        headers.insert(header, wire::nats_message_id(Some("billing"), id).as_str());
        headers.insert(
            wire::AUTHORIZATION_HEADER,
            format!("Bearer {}", self.token).as_str(),
        );
        headers.insert(wire::PRODUCER_EPOCH_HEADER, epoch.to_string().as_str());
        let body = json!({"messageId": id, "sequence": sequence, "amount": sequence});
        let subject = wire::subject_for("ordered", aggregate);
        publish_acked(js, subject, headers, body.to_string()).await;
    }

    /// Publishes billing's `id` at `sequence` under its current epoch.
    async fn send(&self, js: &jetstream::Context, aggregate: &str, id: &str, sequence: i64) {
        self.publish(js, self.epoch, (aggregate, id, sequence), false)
            .await;
    }
}

/// The sequences of the aggregate's `applied` events, in the order they were recorded.
async fn applied_sequences(app: &TestApp, aggregate: &str) -> Vec<i64> {
    let (_, timeline) = get(app, &format!("/aggregates/{aggregate}/timeline?limit=1000")).await;
    timeline["events"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|event| event["kind"] == "applied")
        .filter_map(|event| event["sequence"].as_i64())
        .collect()
}

/// `GET /broker`.
async fn broker_status(app: &TestApp) -> Value {
    let (status, body) = get(app, "/broker").await;
    assert_eq!(status, 200, "{body}");
    body
}

/// A deterministic shuffle (xorshift), so that a failure can be replayed.
fn shuffled<T>(mut items: Vec<T>, mut seed: u64) -> Vec<T> {
    for i in (1..items.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        items.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    items
}

async fn a_producers_shuffled_duplicated_broker_messages_are_held_and_apply_once_in_order(
    backend: Backend,
) {
    const AGGREGATES: usize = 3;
    const PER: i64 = 20;
    let (_nats, app, js) = consumer_that_never_waits_for_a_nak(backend).await;
    let billing = Billing::start(&app).await;
    // Each aggregate's first message claims it for billing; the rest come in any order, every
    // fourth one twice (a resend, which JetStream stores again).
    for a in 0..AGGREGATES {
        billing
            .send(&js, &format!("p{a}"), &format!("p{a}-1"), 1)
            .await;
    }
    let rest: Vec<(usize, i64)> = (0..AGGREGATES)
        .flat_map(|a| (2..=PER).map(move |sequence| (a, sequence)))
        .collect();
    let mut published = AGGREGATES;
    for (n, (a, sequence)) in shuffled(rest, 0x5eed).into_iter().enumerate() {
        let (aggregate, id) = (format!("p{a}"), format!("p{a}-{sequence}"));
        let copies = if n % 4 == 0 { 2 } else { 1 };
        for copy in 0..copies {
            let message = (aggregate.as_str(), id.as_str(), sequence);
            billing.publish(&js, billing.epoch, message, copy > 0).await;
            published += 1;
        }
    }

    for a in 0..AGGREGATES {
        let aggregate = format!("p{a}");
        let path = format!("/aggregates/{aggregate}");
        let view = poll_until(
            &format!("{aggregate} at {PER}"),
            || get(&app, &path),
            |(_, view)| view["last"] == PER,
        )
        .await
        .1;
        assert_eq!(view["total"], (1..=PER).sum::<i64>(), "{view}");
        assert_eq!(view["heldCount"], 0, "{view}");
        assert_eq!(view["owner"]["producer"], "billing", "{view}");
        let expected: Vec<String> = (1..=PER)
            .map(|s| format!("{aggregate}-{s}|billing"))
            .collect();
        assert_eq!(
            applied_by(&app, &aggregate),
            expected,
            "once each, as billing's"
        );
        let in_order: Vec<i64> = (1..=PER).collect();
        assert_eq!(applied_sequences(&app, &aggregate).await, in_order);
    }
    let status = poll_until(
        "every delivery answered",
        || broker_status(&app),
        |status| status["counters"]["messages"] == published,
    )
    .await;
    let counters = &status["counters"];
    assert_eq!(
        (&counters["nakd"], &counters["terminated"]),
        (&json!(0), &json!(0)),
        "early messages are held, not nak'd: {status}"
    );
    assert!(counters["outcomes"]["held"].as_i64() > Some(0), "{status}");
    assert!(rejected_list(&app).await.is_empty());
    app.stop().await;
}

async fn a_gap_skip_drains_a_producers_held_successors_as_that_producer_in_its_own_transaction(
    backend: Backend,
) {
    let (_nats, app, js) = consumer_that_never_waits_for_a_nak(backend).await;
    let operator = add_operator(&app, "alice");
    let billing = Billing::start(&app).await;
    billing.send(&js, "acct", "m-1", 1).await;
    // 2 was lost upstream; 3 and 4 wait for it, held.
    billing.send(&js, "acct", "m-4", 4).await;
    billing.send(&js, "acct", "m-3", 3).await;
    holding(&app, "acct", json!([3, 4])).await;
    let body = json!({
        "action": "skip",
        "from": 2,
        "through": 2,
        "expectedLast": 1,
        "reason": "lost upstream: billing crashed before sending it",
    });
    let path = "/aggregates/acct/gaps/resolution";
    let (status, resolved) = resolve_at(&app, Some(&operator), path, &body).await;
    assert_eq!(status, 200, "{resolved}");
    let drained: Vec<(Value, Value)> = resolved["drained"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| (d["sequence"].clone(), d["outcome"].clone()))
        .collect();
    assert_eq!(
        drained,
        [(json!(3), json!("applied")), (json!(4), json!("applied"))]
    );
    let (_, view) = get(&app, "/aggregates/acct").await;
    assert_eq!(
        (&view["last"], &view["total"], &view["heldSequences"]),
        (&json!(4), &json!(8), &json!([])),
        "{view}"
    );
    assert_eq!(
        applied_by(&app, "acct"),
        ["m-1|billing", "m-3|billing", "m-4|billing"]
    );
    // Decided and written with the skip: the drained rows carry the resolution's time.
    let applied_at = app.inbox_rows(
        "SELECT applied_at FROM ordered_inbox WHERE aggregate_id = 'acct' AND sequence >= 3",
    );
    let resolved_at = resolved["resolvedAt"].as_str().unwrap_or("").to_owned();
    assert_eq!(applied_at, [resolved_at.clone(), resolved_at]);
    assert!(rejected_list(&app).await.is_empty());
    app.stop().await;
}

async fn a_producers_held_message_fenced_or_revoked_before_the_drain_is_refused_and_listed(
    backend: Backend,
) {
    let (_nats, app, js) = consumer_that_never_waits_for_a_nak(backend).await;
    let operator = add_operator(&app, "alice");
    let billing = Billing::start(&app).await;
    for aggregate in ["fenced", "revoked"] {
        billing
            .send(&js, aggregate, &format!("{aggregate}-1"), 1)
            .await;
        billing
            .send(&js, aggregate, &format!("{aggregate}-3"), 3)
            .await;
        holding(&app, aggregate, json!([3])).await;
    }

    // A new instance of billing fences epoch 1; its own 2 applies, and the drain refuses the
    // held 3 that the old instance sent.
    let newer = epoch(&app, &billing.token).await;
    billing
        .publish(&js, newer, ("fenced", "fenced-2", 2), false)
        .await;
    let view = holding(&app, "fenced", json!([])).await;
    assert_eq!((&view["last"], &view["total"]), (&json!(2), &json!(3)));
    assert_eq!(
        applied_by(&app, "fenced"),
        ["fenced-1|billing", "fenced-2|billing"]
    );

    // billing revoked: an operator's skip of the missing 2 drains nothing of billing's.
    let revoked = producer_command(&["revoke", "billing"], &app);
    assert!(revoked.status.success(), "{revoked:?}");
    let body = json!({
        "action": "skip",
        "from": 2,
        "through": 2,
        "expectedLast": 1,
        "reason": "billing is retired",
    });
    let path = "/aggregates/revoked/gaps/resolution";
    let (status, resolved) = resolve_at(&app, Some(&operator), path, &body).await;
    assert_eq!(status, 200, "{resolved}");
    let view = holding(&app, "revoked", json!([])).await;
    assert_eq!((&view["last"], &view["total"]), (&json!(2), &json!(1)));
    assert_eq!(applied_by(&app, "revoked"), ["revoked-1|billing"]);

    let rejected = rejected_list(&app).await;
    assert_eq!(
        outcomes(&rejected),
        [
            ("fenced-3".to_owned(), "fenced".to_owned()),
            ("revoked-3".to_owned(), "unauthorized".to_owned())
        ]
    );
    for (entry, aggregate) in rejected.iter().zip(["fenced", "revoked"]) {
        assert_eq!(
            (&entry["producer"], &entry["aggregateId"]),
            (&json!("billing"), &json!(aggregate)),
            "{entry}"
        );
        assert!(
            entry["reason"]
                .as_str()
                .is_some_and(|reason| reason.contains("held for sequence 3")),
            "{entry}"
        );
    }
    for aggregate in ["fenced", "revoked"] {
        let id = format!("{aggregate}-3");
        assert_eq!(held_rejected_events(&app, aggregate).await, [id]);
    }
    app.stop().await;
}

crate::on_both_backends!(
    a_producers_shuffled_duplicated_broker_messages_are_held_and_apply_once_in_order,
    a_gap_skip_drains_a_producers_held_successors_as_that_producer_in_its_own_transaction,
    a_producers_held_message_fenced_or_revoked_before_the_drain_is_refused_and_listed,
    a_transfer_rejects_held_anonymous_messages_so_the_owners_own_sequence_applies,
    a_skip_after_a_transfer_drains_no_held_anonymous_message_into_the_owned_aggregate,
    a_held_anonymous_message_left_on_an_owned_aggregate_is_rejected_by_the_next_drain,
    a_held_message_whose_sequence_another_message_took_is_rejected_as_stale_and_listed,
    the_rejected_list_is_paged_and_survives_a_restart,
);
