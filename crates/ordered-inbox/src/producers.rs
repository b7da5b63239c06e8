//! Producers: who may write an aggregate's sequence. A producer is registered on the machine like
//! an operator (a name and the hash of a token, see [`crate::operators`]); each running instance
//! starts a *session*, which issues the producer's next *epoch*. A delivery made under an older
//! epoch is *fenced*: a newer instance of the same producer has taken over (Kafka's producer id
//! and epoch). An aggregate is *owned* by at most one producer: the first authenticated delivery
//! to an aggregate without history claims it; afterwards only its owner may write it, and an
//! operator may transfer it.
//!
//! Everything here is pure: a backend reads `OwnershipFacts` in the same transaction as the
//! delivery's other facts and writes the claim `crate::change::Change`s it is given.

use crate::change::Change;
use crate::facts::{HeldMessage, OwnershipFacts, ProducerFact, TransferFacts};
use crate::records::{
    AggregateOwner, ProducerClaim, ProducerRefusal, TransferRecord, TransferRefusal,
};
use crate::rejected::{HeldRejection, reject_held};
use crate::timeline::{TimelineDetail, TimelineEntry, TimelineKind};

/// What an admitted delivery does about ownership before it is decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Anonymous, to an unowned aggregate: today's behaviour.
    Anonymous,
    /// The producer owns the aggregate.
    Owner,
    /// The producer claims the aggregate with this delivery.
    Claim(AggregateOwner),
}

/// Decides whether a delivery may be decided at all. Epoch checks come first (a fenced instance
/// learns it is fenced whatever it writes), then ownership.
pub fn admit(
    claim: Option<&ProducerClaim>,
    facts: &OwnershipFacts,
) -> Result<Admission, ProducerRefusal> {
    let Some(claim) = claim else {
        return match &facts.owner {
            Some(_) => Err(ProducerRefusal::OwnerRequired),
            None => Ok(Admission::Anonymous),
        };
    };
    let producer = match facts.producer {
        Some(producer) if producer.active => producer,
        _ => return Err(ProducerRefusal::Revoked),
    };
    if producer.current_epoch < 1 {
        return Err(ProducerRefusal::NoSession);
    }
    if claim.epoch < 1 || claim.epoch > producer.current_epoch {
        return Err(ProducerRefusal::EpochNotIssued {
            offered: claim.epoch,
            current_epoch: producer.current_epoch,
        });
    }
    if claim.epoch < producer.current_epoch
        && !crate::planted::active(crate::planted::Bug::AcceptFencedEpoch)
    {
        return Err(ProducerRefusal::Fenced {
            offered: claim.epoch,
            current_epoch: producer.current_epoch,
        });
    }
    match &facts.owner {
        Some(owner) if owner.producer == claim.producer => Ok(Admission::Owner),
        Some(owner) => Err(ProducerRefusal::NotOwner {
            owner: owner.producer.clone(),
        }),
        None if facts.history => Err(ProducerRefusal::ClaimRequiresOperator),
        None => Ok(Admission::Claim(AggregateOwner {
            producer: claim.producer.clone(),
            epoch: claim.epoch,
        })),
    }
}

/// Decides whether a held message may still write its aggregate, whose owner is `owner`: the
/// admission its own delivery would pass now, against its producer's row as it is now. The
/// aggregate has history (the held row itself), so a held message never claims it.
pub(crate) fn admit_held(
    held: &HeldMessage,
    owner: Option<&AggregateOwner>,
) -> Result<(), ProducerRefusal> {
    let facts = OwnershipFacts {
        producer: held.producer_now,
        owner: owner.cloned(),
        history: true,
    };
    admit(held.claim.as_ref(), &facts).map(|_| ())
}

/// A session: the epoch the next one gets.
pub fn next_epoch(fact: ProducerFact) -> Result<i64, ProducerRefusal> {
    if !fact.active {
        return Err(ProducerRefusal::Revoked);
    }
    Ok(fact.current_epoch.saturating_add(1))
}

/// An operator's transfer of an aggregate to a producer, with preconditions like a resolution's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferRequest {
    /// The aggregate whose ownership moves.
    pub aggregate_id: String,
    /// The operator who transfers it, as named in the registry.
    pub operator: String,
    /// The producer that receives it.
    pub producer: String,
    /// The owner the operator believes the aggregate has (`None`: unowned).
    pub expected_owner: Option<String>,
    /// The last applied sequence the operator believes the aggregate has.
    pub expected_last: i64,
    /// Why, for the audit row.
    pub reason: String,
}

/// A decided transfer and the rows that record it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) struct TransferPlan {
    /// The transfer's audit record.
    pub record: TransferRecord,
    /// The changes that record it, in order.
    pub changes: Vec<Change>,
}

/// Decides an operator's transfer. The new owner's epoch is the producer's current one.
///
/// Each held message must pass the admission its own delivery would pass under the new owner
/// (`admit_held`), and one that no longer may write the aggregate (an anonymous one, another
/// producer's) is rejected in the same plan, so no held message outlives its right to apply.
#[cfg_attr(feature = "testing", visibility::make(pub))]
pub(crate) fn decide_transfer(
    request: &TransferRequest,
    facts: &TransferFacts,
    now: &str,
) -> Result<TransferPlan, TransferRefusal> {
    if !facts.operator_active {
        return Err(TransferRefusal::Unauthorized);
    }
    let producer = match facts.producer {
        Some(producer) if producer.active => producer,
        _ => return Err(TransferRefusal::UnknownProducer),
    };
    let owner = facts.owner.as_ref().map(|owner| owner.producer.as_str());
    if owner != request.expected_owner.as_deref() {
        return Err(TransferRefusal::OwnerMismatch);
    }
    if facts.last != request.expected_last {
        return Err(TransferRefusal::LastMismatch);
    }
    let new_owner = AggregateOwner {
        producer: request.producer.clone(),
        epoch: producer.current_epoch,
    };
    let inadmissible: Vec<_> = facts
        .held
        .iter()
        .filter_map(|held| {
            let refusal = admit_held(held, Some(&new_owner)).err()?;
            Some((held, HeldRejection::Refused(refusal)))
        })
        .collect();
    let record = TransferRecord {
        aggregate_id: request.aggregate_id.clone(),
        operator: request.operator.clone(),
        from_owner: owner.map(str::to_owned),
        to_owner: request.producer.clone(),
        epoch: producer.current_epoch,
        last: facts.last,
        reason: request.reason.clone(),
        transferred_at: now.to_owned(),
        held_rejected: inadmissible.len(),
    };
    let mut changes = transfer_changes(&record).to_vec();
    if record.from_owner.is_some()
        && crate::planted::active(crate::planted::Bug::TransferKeepsOldOwner)
    {
        changes.retain(|change| !matches!(change, Change::SetOwner { .. }));
    }
    for (held, why) in &inadmissible {
        reject_held(held, why, now, &mut changes);
    }
    Ok(TransferPlan { record, changes })
}

/// The transfer's own rows, in this order: the aggregate's owner columns, the audit row and
/// the timeline event, all stamped with `transferred_at`.
fn transfer_changes(record: &TransferRecord) -> [Change; 3] {
    [
        Change::SetOwner {
            aggregate_id: record.aggregate_id.clone(),
            owner: AggregateOwner {
                producer: record.to_owner.clone(),
                epoch: record.epoch,
            },
            at: record.transferred_at.clone(),
        },
        Change::RecordTransfer(record.clone()),
        Change::Append(TimelineEntry {
            aggregate_id: record.aggregate_id.clone(),
            at: record.transferred_at.clone(),
            kind: TimelineKind::OwnerTransferred,
            sequence: None,
            message_id: None,
            detail: TimelineDetail::Transferred {
                operator: record.operator.clone(),
                from: record.from_owner.clone(),
                to: record.to_owner.clone(),
                epoch: record.epoch,
                reason: record.reason.clone(),
            },
        }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(producer: &str, epoch: i64) -> ProducerClaim {
        ProducerClaim {
            producer: producer.into(),
            epoch,
        }
    }

    fn facts(current_epoch: i64, owner: Option<(&str, i64)>, history: bool) -> OwnershipFacts {
        OwnershipFacts {
            producer: Some(ProducerFact {
                current_epoch,
                active: true,
            }),
            owner: owner.map(|(producer, epoch)| AggregateOwner {
                producer: producer.into(),
                epoch,
            }),
            history,
        }
    }

    #[test]
    fn an_older_epoch_is_fenced_and_a_newer_one_was_never_issued() {
        let known = facts(3, Some(("billing", 1)), true);
        assert_eq!(
            admit(Some(&claim("billing", 2)), &known),
            Err(ProducerRefusal::Fenced {
                offered: 2,
                current_epoch: 3
            })
        );
        assert_eq!(
            admit(Some(&claim("billing", 4)), &known),
            Err(ProducerRefusal::EpochNotIssued {
                offered: 4,
                current_epoch: 3
            })
        );
        assert_eq!(
            admit(Some(&claim("billing", 0)), &known),
            Err(ProducerRefusal::EpochNotIssued {
                offered: 0,
                current_epoch: 3
            })
        );
        assert_eq!(
            admit(Some(&claim("billing", 3)), &known),
            Ok(Admission::Owner)
        );
    }

    #[test]
    fn the_first_authenticated_delivery_to_a_fresh_aggregate_claims_it() {
        assert_eq!(
            admit(Some(&claim("billing", 2)), &facts(2, None, false)),
            Ok(Admission::Claim(AggregateOwner {
                producer: "billing".into(),
                epoch: 2
            }))
        );
        assert_eq!(
            admit(Some(&claim("billing", 2)), &facts(2, None, true)),
            Err(ProducerRefusal::ClaimRequiresOperator)
        );
    }

    #[test]
    fn another_producer_is_not_the_owner_and_an_anonymous_one_must_authenticate() {
        let owned = facts(1, Some(("billing", 1)), true);
        assert_eq!(
            admit(Some(&claim("shipping", 1)), &owned),
            Err(ProducerRefusal::NotOwner {
                owner: "billing".into()
            })
        );
        assert_eq!(admit(None, &owned), Err(ProducerRefusal::OwnerRequired));
        assert_eq!(
            admit(None, &OwnershipFacts::default()),
            Ok(Admission::Anonymous)
        );
    }

    #[test]
    fn a_revoked_or_sessionless_producer_writes_nothing() {
        let revoked = OwnershipFacts {
            producer: Some(ProducerFact {
                current_epoch: 2,
                active: false,
            }),
            ..Default::default()
        };
        assert_eq!(
            admit(Some(&claim("billing", 2)), &revoked),
            Err(ProducerRefusal::Revoked)
        );
        assert_eq!(
            admit(Some(&claim("billing", 1)), &facts(0, None, false)),
            Err(ProducerRefusal::NoSession)
        );
        assert_eq!(
            next_epoch(ProducerFact {
                current_epoch: 4,
                active: true
            }),
            Ok(5)
        );
    }

    #[test]
    fn a_transfer_checks_the_operator_the_producer_and_both_preconditions() {
        let request = TransferRequest {
            aggregate_id: "acct".into(),
            operator: "alice".into(),
            producer: "shipping".into(),
            expected_owner: Some("billing".into()),
            expected_last: 3,
            reason: "billing retired".into(),
        };
        let facts = TransferFacts {
            operator_active: true,
            producer: Some(ProducerFact {
                current_epoch: 7,
                active: true,
            }),
            owner: Some(AggregateOwner {
                producer: "billing".into(),
                epoch: 1,
            }),
            last: 3,
            held: Vec::new(),
        };
        let record = decide_transfer(&request, &facts, "t1").unwrap().record;
        assert_eq!(
            (record.from_owner.as_deref(), record.epoch),
            (Some("billing"), 7)
        );
        let stale = TransferFacts {
            last: 4,
            ..facts.clone()
        };
        assert_eq!(
            decide_transfer(&request, &stale, "t1"),
            Err(TransferRefusal::LastMismatch)
        );
        let unowned = TransferFacts {
            owner: None,
            ..facts.clone()
        };
        assert_eq!(
            decide_transfer(&request, &unowned, "t1"),
            Err(TransferRefusal::OwnerMismatch)
        );
        let nobody = TransferFacts {
            operator_active: false,
            ..facts
        };
        assert_eq!(
            decide_transfer(&request, &nobody, "t1"),
            Err(TransferRefusal::Unauthorized)
        );
    }

    #[test]
    fn a_transfer_rejects_every_held_anonymous_message_it_makes_inadmissible() {
        let request = TransferRequest {
            aggregate_id: "a".into(),
            operator: "alice".into(),
            producer: "billing".into(),
            expected_owner: None,
            expected_last: 0,
            reason: "billing takes over".into(),
        };
        let held = |id: &str, sequence| {
            let message = crate::policy::tests::order(id, sequence, 1);
            crate::facts::HeldMessage {
                payload: crate::content::canonical_json(&message.payload),
                message,
                held_at: "t0".into(),
                claim: None,
                producer_now: None,
            }
        };
        let facts = TransferFacts {
            operator_active: true,
            producer: Some(ProducerFact {
                current_epoch: 2,
                active: true,
            }),
            owner: None,
            last: 0,
            held: vec![held("x-2", 2), held("x-3", 3)],
        };
        let plan = decide_transfer(&request, &facts, "t1").unwrap();
        assert_eq!(plan.record.held_rejected, 2);
        let released: Vec<&str> = plan
            .changes
            .iter()
            .filter_map(|change| match change {
                Change::ReleaseHeld { message_id, .. } => Some(message_id.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(released, ["x-2", "x-3"]);
        assert!(plan.changes.iter().any(|change| matches!(
            change,
            Change::RecordRejected(entry)
                if entry.outcome == "owner required" && entry.reason.contains("sequence 3")
        )));
        let without = TransferFacts {
            held: Vec::new(),
            ..facts
        };
        let plain = decide_transfer(&request, &without, "t1").unwrap();
        assert_eq!((plain.record.held_rejected, plain.changes.len()), (0, 3));
    }

    #[test]
    fn a_transfer_keeps_only_the_new_owners_held_messages_sent_under_its_current_epoch() {
        let held = |id: &str, sequence, epoch| {
            let message = crate::policy::tests::order(id, sequence, 1);
            crate::facts::HeldMessage {
                payload: crate::content::canonical_json(&message.payload),
                message,
                held_at: "t0".into(),
                claim: Some(ProducerClaim {
                    producer: "billing".into(),
                    epoch,
                }),
                producer_now: Some(ProducerFact {
                    current_epoch: 2,
                    active: true,
                }),
            }
        };
        let facts = TransferFacts {
            operator_active: true,
            producer: Some(ProducerFact {
                current_epoch: 1,
                active: true,
            }),
            owner: Some(AggregateOwner {
                producer: "billing".into(),
                epoch: 1,
            }),
            last: 1,
            held: vec![held("m-3", 3, 2), held("m-4", 4, 1)],
        };
        let to = |producer: &str| TransferRequest {
            aggregate_id: "a".into(),
            operator: "alice".into(),
            producer: producer.into(),
            expected_owner: Some("billing".into()),
            expected_last: 1,
            reason: "reassigned".into(),
        };
        let outcomes = |plan: &TransferPlan| -> Vec<(String, String)> {
            plan.changes
                .iter()
                .filter_map(|change| match change {
                    Change::RecordRejected(entry) => Some((
                        entry.message_id.clone().unwrap_or_default(),
                        entry.outcome.clone(),
                    )),
                    _ => None,
                })
                .collect()
        };
        let shipping = decide_transfer(&to("shipping"), &facts, "t1").unwrap();
        assert_eq!(
            outcomes(&shipping),
            [
                ("m-3".to_owned(), "not the owner".to_owned()),
                ("m-4".to_owned(), "fenced".to_owned())
            ]
        );
        let billing_facts = TransferFacts {
            producer: Some(ProducerFact {
                current_epoch: 2,
                active: true,
            }),
            ..facts
        };
        let billing = decide_transfer(&to("billing"), &billing_facts, "t1").unwrap();
        assert_eq!(billing.record.held_rejected, 1);
        assert_eq!(
            outcomes(&billing),
            [("m-4".to_owned(), "fenced".to_owned())]
        );
    }
}
