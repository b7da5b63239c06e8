//! The wire format of ordered messages on NATS, shared by the consumer, the bench and the tests.
//!
//! - **Subject**: `PREFIX.TOKEN`, where `TOKEN` is the aggregate id escaped to one subject token.
//!   Aggregate ids are 1..64 characters of `A-Za-z0-9._:-`; a subject token may not contain `.`
//!   (nor `*`, `>` or whitespace, which ids never have). The escape character is `%`: `.` is
//!   written `%2E` and `%` itself `%25` (ids never contain `%`, but the rule is total, so every
//!   token decodes to one id and back). Nothing else may follow a `%`; hex digits are upper case.
//!   `acct.7` travels as `ordered.acct%2E7`.
//! - With partitions (a subject mapping in the NATS server, see `docs/broker.md`) the stream
//!   stores `PREFIX.K.TOKEN`, where `K` is the partition the server computed from `TOKEN`.
//! - **Header** `Nats-Msg-Id: <messageId>`: JetStream drops a re-publish inside its duplicate
//!   window, and the body's `messageId` must be the same. A producer's message (below) carries
//!   `Nats-Msg-Id: <producer>/<messageId>`: its ids are its own (`(producer, message id)`), so
//!   another producer's same id must not fall into JetStream's duplicate window with it.
//! - **Producer headers** (optional, as on the HTTP general door): `Authorization: Bearer TOKEN`
//!   and `Producer-Epoch: N`, both or neither, one of each; names in any letter case; `N` as
//!   [`parse_epoch`] reads it on every door.
//! - **Body**: the HTTP general door's JSON, `{"messageId","sequence","amount"}` with an optional
//!   `aggregateId` that must name the subject's aggregate.
//! - **A resend** (a relay answering a gap notice) carries no `Nats-Msg-Id` but
//!   `Resend-Msg-Id: <the Nats-Msg-Id of the first publication>`, checked the same way: JetStream
//!   de-duplicates only on `Nats-Msg-Id`, and keeps that id's entry for its whole duplicate window
//!   even when the message itself was deleted, so a copy that must fill a gap would be dropped.
//! - **Gap notices** (core NATS, published by the consumer): `gaps.PREFIX.TOKEN`, the body a
//!   [`GapNotice`].

use crate::model::{AggregateStatus, OrderedMessage};
use crate::views::AggregateView;
use serde::{Deserialize, Serialize};

/// The header JetStream de-duplicates on.
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";
/// A producer's token, `Bearer TOKEN`, as on the HTTP general door.
pub const AUTHORIZATION_HEADER: &str = "Authorization";
/// The epoch of the producer's session, as on the HTTP general door.
pub const PRODUCER_EPOCH_HEADER: &str = "Producer-Epoch";
/// A resend's message id header, in place of [`MESSAGE_ID_HEADER`], so that JetStream keeps it.
pub const RESEND_HEADER: &str = "Resend-Msg-Id";

/// The id header a delivery is read with: its `Nats-Msg-Id`, or a resend's `Resend-Msg-Id`.
pub fn delivery_id<'a>(nats_ids: &[&'a str], resend_ids: &[&'a str]) -> Option<&'a str> {
    nats_ids.first().or(resend_ids.first()).copied()
}

/// The subject of the gap notices about the aggregate's messages published under `prefix`.
pub fn gap_subject_for(prefix: &str, aggregate_id: &str) -> String {
    format!(
        "{}.{}",
        crate::jetstream::config::gap_subject_prefix(prefix),
        encode_aggregate(aggregate_id)
    )
}

/// The subjects of every gap notice about messages published under `prefix`.
pub fn gap_subjects(prefix: &str) -> String {
    format!("{}.*", crate::jetstream::config::gap_subject_prefix(prefix))
}

/// What a consumer tells the producers of an aggregate that waits for a missing sequence: the
/// range it lacks (`from`, the sequence it expects, through one below the lowest it holds), what
/// it holds, and since when it waits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GapNotice {
    /// The waiting aggregate.
    pub aggregate_id: String,
    /// The sequences it waits for.
    pub missing: MissingRange,
    /// The sequences held behind the missing ones.
    pub held_sequences: Vec<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Since when it waits, if known.
    pub waiting_since: Option<String>,
}

/// The sequences `from` through `through`, both included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingRange {
    /// The first missing sequence.
    pub from: i64,
    /// The last missing sequence.
    pub through: i64,
}

impl GapNotice {
    /// The notice an aggregate's view calls for: only a `waiting` one that holds a sequence above
    /// the one it expects (a blocked aggregate waits for an operator, not for a resend).
    pub fn of_view(view: &AggregateView) -> Option<GapNotice> {
        let summary = &view.summary;
        let lowest_held = *view.held_sequences.first()?;
        if summary.status != AggregateStatus::Waiting || lowest_held <= summary.expected {
            return None;
        }
        Some(GapNotice {
            aggregate_id: summary.aggregate_id.clone(),
            missing: MissingRange {
                from: summary.expected,
                through: lowest_held - 1,
            },
            held_sequences: view.held_sequences.clone(),
            waiting_since: summary.since.clone(),
        })
    }
}

/// A producer's credential read from a message's headers; the token is never logged.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    /// The producer's token.
    pub token: String,
    /// The epoch of its session.
    pub epoch: i64,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Credential")
            .field("token", &"…")
            .field("epoch", &self.epoch)
            .finish()
    }
}

/// The `Nats-Msg-Id` of a message: its id, or `producer/id` for a producer's (producer names
/// never contain `/`, so the two never meet).
pub fn nats_message_id(producer: Option<&str>, message_id: &str) -> String {
    match producer {
        Some(producer) => format!("{producer}/{message_id}"),
        None => message_id.to_owned(),
    }
}

/// A message's producer credential from every value of its `Authorization` and
/// `Producer-Epoch` headers: `None` without either (anonymous). The error (a malformed message)
/// never repeats the token. Stricter than the HTTP door on one point: an epoch without a token
/// is refused rather than ignored, since a producer that lost its token would otherwise be
/// delivered anonymously, in the anonymous namespace, where the broker's termination is final.
pub fn read_credential(
    authorization: &[&str],
    epoch: &[&str],
) -> Result<Option<Credential>, String> {
    const EPOCH_ADVICE: &str = "a producer's message needs one Producer-Epoch header: the epoch POST /producers/session answered, a whole number from 1 in digits only (no sign, no leading zero)";
    let token = match authorization {
        [] if epoch.is_empty() => return Ok(None),
        [] => {
            return Err(
                "a Producer-Epoch header without an Authorization header: send the producer's token too (or neither, for an anonymous message)"
                    .to_owned(),
            );
        }
        [value] => match bearer_token(value) {
            Some(token) => token.to_owned(),
            None => {
                return Err(
                    "the Authorization header must be Bearer TOKEN with a producer's token"
                        .to_owned(),
                );
            }
        },
        _ => {
            return Err("two Authorization headers are an ambiguous credential".to_owned());
        }
    };
    let [value] = epoch else {
        return Err(EPOCH_ADVICE.to_owned());
    };
    let epoch = parse_epoch(value).ok_or_else(|| EPOCH_ADVICE.to_owned())?;
    Ok(Some(Credential { token, epoch }))
}

/// The token of one `Bearer TOKEN` value (surrounding blanks aside), or `None` for any other
/// scheme or an empty token. The HTTP doors read their `Authorization` header with it too.
pub fn bearer_token(value: &str) -> Option<&str> {
    let mut parts = value.trim().splitn(2, ' ');
    let scheme = parts.next().unwrap_or_default();
    let token = parts.next().unwrap_or_default().trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The largest number of digits an epoch can have (`i64::MAX` has 19).
const MAX_EPOCH_DIGITS: usize = 19;

/// The epoch a `Producer-Epoch` header's text names, read alike on every door: ASCII digits only,
/// no sign, no leading zero, at least 1, at most `i64::MAX`, so that `+4`, `04` or `000004`
/// never pass for epoch 4. Whitespace around the value is not part of it (HTTP's optional
/// whitespace, a NATS header written with a space after the colon). `None` for anything else.
pub fn parse_epoch(text: &str) -> Option<i64> {
    let digits = text.trim();
    let canonical = (1..=MAX_EPOCH_DIGITS).contains(&digits.len())
        && digits.bytes().all(|byte| byte.is_ascii_digit())
        && !digits.starts_with('0');
    if !canonical {
        return None;
    }
    digits.parse::<i64>().ok()
}

/// The aggregate id as one subject token.
pub fn encode_aggregate(aggregate_id: &str) -> String {
    let mut token = String::with_capacity(aggregate_id.len());
    for character in aggregate_id.chars() {
        match character {
            '%' => token.push_str("%25"),
            '.' => token.push_str("%2E"),
            other => token.push(other),
        }
    }
    token
}

/// The aggregate id a subject token carries; the error says what is wrong with the token.
pub fn decode_aggregate(token: &str) -> Result<String, String> {
    let mut aggregate_id = String::with_capacity(token.len());
    let mut rest = token;
    while let Some(position) = rest.find('%') {
        aggregate_id.push_str(&rest[..position]);
        let escape = rest
            .get(position..position + 3)
            .unwrap_or(&rest[position..]);
        match escape {
            "%2E" => aggregate_id.push('.'),
            "%25" => aggregate_id.push('%'),
            other => {
                return Err(format!(
                    "the subject token '{token}' has an unknown escape '{other}' (only %2E and %25)"
                ));
            }
        }
        rest = &rest[position + escape.len()..];
    }
    aggregate_id.push_str(rest);
    Ok(aggregate_id)
}

/// The subject a producer publishes one aggregate's messages to.
pub fn subject_for(prefix: &str, aggregate_id: &str) -> String {
    format!("{prefix}.{}", encode_aggregate(aggregate_id))
}

/// The aggregate id of a stored subject: `PREFIX.TOKEN`, or `PREFIX.K.TOKEN` when the stream is
/// partitioned (`partition` is then the one this consumer owns).
pub fn aggregate_of_subject(
    prefix: &str,
    partition: Option<u32>,
    subject: &str,
) -> Result<String, String> {
    let rest = subject
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix('.'))
        .ok_or_else(|| format!("the subject '{subject}' does not start with '{prefix}.'"))?;
    let token = match partition {
        None => rest,
        Some(partition) => {
            let (number, token) = rest.split_once('.').ok_or_else(|| {
                format!(
                    "the subject '{subject}' has no partition token (expected {prefix}.K.AGGREGATE)"
                )
            })?;
            if number != partition.to_string() {
                return Err(format!(
                    "the subject '{subject}' is in partition '{number}', not {partition}"
                ));
            }
            token
        }
    };
    if token.is_empty() || token.contains('.') {
        return Err(format!(
            "the subject '{subject}' must end in exactly one aggregate token"
        ));
    }
    decode_aggregate(token)
}

/// Why a delivery is malformed, with what could still be read of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    /// The aggregate its subject named, when it could be read.
    pub aggregate_id: Option<String>,
    /// The message id, when it could be read.
    pub message_id: Option<String>,
    /// Why it is malformed.
    pub reason: String,
}

/// Reads one delivery: its subject, its `Nats-Msg-Id` header (if any) and its body. `body`
/// checks the JSON as the HTTP general door does (the server passes its own validation).
/// `producer` is the producer whose token the message carries (`None`: anonymous): its
/// `Nats-Msg-Id` must then be [`nats_message_id`]'s `producer/messageId`.
pub fn read_delivery(
    prefix: &str,
    partition: Option<u32>,
    subject: &str,
    header_id: Option<&str>,
    producer: Option<&str>,
    body: impl FnOnce(String) -> Result<OrderedMessage, String>,
) -> Result<OrderedMessage, Malformed> {
    let malformed = |aggregate_id: Option<String>, reason: String| Malformed {
        aggregate_id,
        message_id: header_id.map(str::to_owned),
        reason,
    };
    let aggregate_id = aggregate_of_subject(prefix, partition, subject)
        .map_err(|reason| malformed(None, reason))?;
    let Some(header_id) = header_id else {
        return Err(malformed(
            Some(aggregate_id),
            format!("the {MESSAGE_ID_HEADER} header is missing"),
        ));
    };
    let message = body(aggregate_id.clone())
        .map_err(|reason| malformed(Some(aggregate_id.clone()), reason))?;
    let expected = nats_message_id(producer, &message.message_id);
    if expected != header_id {
        return Err(malformed(
            Some(aggregate_id),
            match producer {
                None => format!(
                    "the body's messageId '{}' differs from the {MESSAGE_ID_HEADER} header '{header_id}'",
                    message.message_id
                ),
                Some(producer) => format!(
                    "a message of producer '{producer}' must carry {MESSAGE_ID_HEADER} '{expected}' (its producer, '/', the body's messageId), not '{header_id}'"
                ),
            },
        ));
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(id: &str, aggregate_id: String) -> OrderedMessage {
        OrderedMessage {
            message_id: id.to_owned(),
            aggregate_id,
            sequence: 1,
            payload: serde_json::json!({ "amount": 1 }),
        }
    }

    #[test]
    fn every_valid_aggregate_id_round_trips_through_one_token() {
        let alphabet: Vec<char> = ('A'..='Z')
            .chain('a'..='z')
            .chain('0'..='9')
            .chain(['.', '_', ':', '-'])
            .collect();
        let mut ids: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
        ids.extend(
            [
                "acct.7",
                "..",
                "a.b.c",
                "%",
                "%2E",
                "x%25.y",
                "tenant:42.orders_x",
            ]
            .map(String::from),
        );
        ids.push(".".repeat(64));
        for id in ids {
            let token = encode_aggregate(&id);
            assert!(!token.contains('.') && !token.is_empty(), "{token}");
            assert_eq!(decode_aggregate(&token).as_deref(), Ok(id.as_str()));
            assert_eq!(
                aggregate_of_subject("ordered", None, &subject_for("ordered", &id)).as_deref(),
                Ok(id.as_str())
            );
        }
        assert_eq!(encode_aggregate("acct.7"), "acct%2E7");
    }

    #[test]
    fn undecodable_subjects_say_why() {
        for token in ["a%2", "a%2e", "a%41", "%"] {
            assert!(decode_aggregate(token).is_err(), "{token}");
        }
        assert!(aggregate_of_subject("ordered", None, "other.a").is_err());
        assert!(aggregate_of_subject("ordered", None, "ordered.").is_err());
        assert!(aggregate_of_subject("ordered", None, "ordered.a.b").is_err());
        assert_eq!(
            aggregate_of_subject("ordered", Some(1), "ordered.1.acct%2E7").as_deref(),
            Ok("acct.7")
        );
        assert!(aggregate_of_subject("ordered", Some(1), "ordered.0.a").is_err());
        assert!(aggregate_of_subject("ordered", Some(1), "ordered.a").is_err());
        assert_eq!(
            aggregate_of_subject("lab.ordered", None, "lab.ordered.a").as_deref(),
            Ok("a")
        );
    }

    #[test]
    fn the_header_must_name_the_body_message() {
        let body = |id: &'static str| move |aggregate_id: String| Ok(message(id, aggregate_id));
        let good = read_delivery("ordered", None, "ordered.a", Some("m-1"), None, body("m-1"));
        assert_eq!(good.map(|m| m.aggregate_id).as_deref(), Ok("a"));
        let other = read_delivery("ordered", None, "ordered.a", Some("m-1"), None, body("m-2"));
        assert!(other.unwrap_err().reason.contains("differs"));
        let missing =
            read_delivery("ordered", None, "ordered.a", None, None, body("m-1")).unwrap_err();
        assert_eq!(missing.aggregate_id.as_deref(), Some("a"));
        let broken =
            read_delivery("ordered", None, "ordered.a%zz", Some("m"), None, body("m")).unwrap_err();
        assert_eq!(
            (broken.aggregate_id, broken.message_id.as_deref()),
            (None, Some("m"))
        );
    }

    #[test]
    fn a_producers_message_id_header_names_its_producer() {
        let body = |aggregate_id: String| Ok(message("m-1", aggregate_id));
        let mine = read_delivery(
            "ordered",
            None,
            "ordered.a",
            Some("billing/m-1"),
            Some("billing"),
            body,
        );
        assert_eq!(mine.map(|m| m.message_id).as_deref(), Ok("m-1"));
        let bare = read_delivery(
            "ordered",
            None,
            "ordered.a",
            Some("m-1"),
            Some("billing"),
            body,
        )
        .unwrap_err();
        assert!(bare.reason.contains("'billing/m-1'"), "{}", bare.reason);
        let other = read_delivery(
            "ordered",
            None,
            "ordered.a",
            Some("shipping/m-1"),
            Some("billing"),
            body,
        );
        assert!(other.is_err());
    }

    fn view(status: AggregateStatus, last: i64, held: &[i64]) -> AggregateView {
        AggregateView {
            summary: crate::views::AggregateSummary {
                aggregate_id: "acct.7".to_owned(),
                last,
                expected: last + 1,
                status,
                since: Some("2026-12-01T10:15:02.123Z".to_owned()),
                state: None,
            },
            open_dead_letters: Vec::new(),
            open_dead_letter_count: 0,
            open_dead_letters_truncated: false,
            held_sequences: held.to_vec(),
            held_count: held.len() as i64,
            missing: None,
            waiting_since: None,
        }
    }

    #[test]
    fn a_gap_notice_names_the_missing_range_of_a_waiting_aggregate_only() {
        let notice = GapNotice::of_view(&view(AggregateStatus::Waiting, 1, &[5, 6])).unwrap();
        assert_eq!(
            serde_json::to_value(&notice).unwrap(),
            serde_json::json!({"aggregateId": "acct.7", "missing": {"from": 2, "through": 4},
                               "heldSequences": [5, 6], "waitingSince": "2026-12-01T10:15:02.123Z"})
        );
        assert_eq!(
            gap_subject_for("ordered", "acct.7"),
            "gaps.ordered.acct%2E7"
        );
        assert!(GapNotice::of_view(&view(AggregateStatus::Blocked, 1, &[5])).is_none());
        assert!(GapNotice::of_view(&view(AggregateStatus::Flowing, 4, &[])).is_none());
        assert!(GapNotice::of_view(&view(AggregateStatus::Waiting, 4, &[])).is_none());
    }

    #[test]
    fn a_resend_is_read_by_its_resend_header_when_it_has_no_nats_msg_id() {
        assert_eq!(delivery_id(&["m-1"], &["m-2"]), Some("m-1"));
        assert_eq!(delivery_id(&[], &["m-2"]), Some("m-2"));
        assert_eq!(delivery_id(&[], &[]), None);
    }

    #[test]
    fn producer_headers_come_in_pairs_one_of_each_and_never_echo_the_token() {
        assert_eq!(read_credential(&[], &[]), Ok(None));
        assert_eq!(
            read_credential(&["Bearer s3cret"], &["2"]),
            Ok(Some(Credential {
                token: "s3cret".into(),
                epoch: 2
            }))
        );
        assert_eq!(
            read_credential(&["bearer  s3cret "], &[" 1 "]).map(|c| c.map(|c| c.epoch)),
            Ok(Some(1))
        );
        for (authorization, epoch) in [
            (&[][..], &["1"][..]),
            (&["Bearer s3cret"][..], &[][..]),
            (&["Bearer s3cret"][..], &["0"][..]),
            (&["Bearer s3cret"][..], &["1", "1"][..]),
            (&["Bearer s3cret"][..], &["one"][..]),
            (&["Bearer s3cret"][..], &["+2"][..]),
            (&["Bearer s3cret"][..], &["02"][..]),
            (&["Basic s3cret"][..], &["1"][..]),
            (&["Bearer"][..], &["1"][..]),
            (&["Bearer s3cret", "Bearer s3cret"][..], &["1"][..]),
        ] {
            let refused = read_credential(authorization, epoch);
            let reason = refused.expect_err("refused");
            assert!(!reason.contains("s3cret"), "{reason}");
        }
    }
}
