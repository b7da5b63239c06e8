//! The general door's words for a delivery's verdicts ([`http_edge::inbox::verdicts`]): its
//! routes, a replay and a payload conflict without the message's sequence, and an applied
//! message with the aggregate's last sequence and total.

use ordered_inbox::Detail;
use ordered_inbox::delivery::AppliedRecord;
use serde::Serialize;
use utoipa::ToSchema;

use crate::inbox::input::Delivered;
use http_edge::inbox::verdicts::{self, Door, Words};

pub(super) use http_edge::inbox::verdicts::{
    producer_unauthorized, quarantine_full, refused, verdict_response,
};

/// The general door onto the inbox.
#[derive(ToSchema)]
pub(super) struct GeneralDoor;

pub(super) type DeliveryAccepted = verdicts::DeliveryAccepted<GeneralDoor>;
pub(super) type DeliveryRefused = verdicts::DeliveryRefused<GeneralDoor>;
pub(super) type Quarantined<'a> = verdicts::Quarantined<'a, GeneralDoor>;

impl Door for GeneralDoor {
    const WORDS: Words = Words {
        resolutions: "GET /resolutions",
        resolve_dead_letter: "POST /deadletters/{messageId}/resolution",
        conflicting_content: "other content",
        start_session: "POST /producers/session",
        transfer_owner: "POST /aggregates/{id}/owner",
    };
    type About<'a> = About<'a>;
    type Placed<'a> = MessagePlace<'a>;
    type Applied<'a> = AppliedPlace<'a>;
    type Original = Original;

    fn about(message: &Delivered) -> About<'_> {
        About {
            aggregate_id: &message.aggregate_id,
            message_id: &message.message_id,
        }
    }

    fn placed(message: &Delivered) -> MessagePlace<'_> {
        MessagePlace {
            about: GeneralDoor::about(message),
            sequence: message.sequence,
        }
    }

    fn applied<'a>(message: &'a Delivered, sequence: i64, detail: &Detail) -> AppliedPlace<'a> {
        AppliedPlace {
            about: GeneralDoor::about(message),
            sequence,
            last: sequence,
            total: applied_total(detail),
        }
    }

    fn original(record: AppliedRecord) -> Original {
        Original {
            outcome: "applied",
            sequence: record.sequence,
            applied_at: record.applied_at,
        }
    }
}

/// The aggregate's total after an applied message: the ledger's detail of its `applied` event.
fn applied_total(detail: &Detail) -> i64 {
    detail
        .get("total")
        .and_then(serde_json::Value::as_i64)
        .unwrap_or_default()
}

/// The members every verdict starts with.
#[derive(Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct About<'a> {
    aggregate_id: &'a str,
    message_id: &'a str,
}

/// The members a gap, stale or quarantined verdict starts with: the message's place.
#[derive(Serialize, ToSchema)]
pub(super) struct MessagePlace<'a> {
    #[serde(flatten)]
    about: About<'a>,
    sequence: i64,
}

/// The members an applied verdict starts with: the aggregate's last sequence and total now.
#[derive(Serialize, ToSchema)]
pub(super) struct AppliedPlace<'a> {
    #[serde(flatten)]
    about: About<'a>,
    sequence: i64,
    last: i64,
    total: i64,
}

/// The applied message a replay points at.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct Original {
    outcome: &'static str,
    sequence: i64,
    applied_at: Option<String>,
}
