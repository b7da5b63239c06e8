//! The gate's words for a delivery's verdicts ([`http_edge::inbox::verdicts`]): its `/v1`
//! routes, and every verdict opening with the message's sequence.

use ordered_inbox::Detail;
use ordered_inbox::delivery::AppliedRecord;
use serde::Serialize;
use utoipa::ToSchema;

use http_edge::inbox::input::Delivered;
use http_edge::inbox::verdicts::{self, Door, Words};

pub(super) use http_edge::inbox::verdicts::{refused, verdict_response};

/// The gate's door onto the inbox.
#[derive(ToSchema)]
pub(super) struct GateDoor;

pub(super) type DeliveryAccepted = verdicts::DeliveryAccepted<GateDoor>;
pub(super) type DeliveryRefused = verdicts::DeliveryRefused<GateDoor>;
pub(super) type Quarantined<'a> = verdicts::Quarantined<'a, GateDoor>;

impl Door for GateDoor {
    const WORDS: Words = Words {
        resolutions: "GET /v1/resolutions",
        resolve_dead_letter: "POST /v1/deadletters/resolution?messageId=",
        conflicting_content: "another type or payload",
        start_session: "POST /v1/producers/session",
        transfer_owner: "POST /v1/aggregates/{id}/owner",
    };
    type About<'a> = About<'a>;
    type Placed<'a> = About<'a>;
    type Applied<'a> = About<'a>;
    type Original = Original;

    fn about(message: &Delivered) -> About<'_> {
        About {
            aggregate_id: &message.aggregate_id,
            message_id: &message.message_id,
            sequence: message.sequence,
        }
    }

    fn placed(message: &Delivered) -> About<'_> {
        GateDoor::about(message)
    }

    fn applied<'a>(message: &'a Delivered, sequence: i64, _: &Detail) -> About<'a> {
        About {
            sequence,
            ..GateDoor::about(message)
        }
    }

    fn original(record: AppliedRecord) -> Original {
        Original {
            sequence: record.sequence,
            applied_at: record.applied_at,
        }
    }
}

/// The members every verdict starts with.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct About<'a> {
    aggregate_id: &'a str,
    message_id: &'a str,
    sequence: i64,
}

/// The applied message a replay points at.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct Original {
    sequence: i64,
    applied_at: Option<String>,
}
