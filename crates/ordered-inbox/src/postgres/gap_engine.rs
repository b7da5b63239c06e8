//! A gap resolution's PostgreSQL transaction: the aggregate locked and its facts read, the
//! core's decision, the audit row written and the held successors drained through the handler,
//! as any decision's plan.

use super::connection::Failure;
use super::engine::{Run, Unit, decided, rollback};
use super::gaps::gap_facts;
use super::writes::commit;
use crate::gaps::{GapRequest, GapResolutionError, GapResolved, decide_gap_resolution};
use crate::resolution::Mode;

/// Checks the preconditions and resolves the gap, or (dry run) reports what that would do: the
/// aggregate locked, the facts, the core's decision, the audit row and the drain through the
/// handler, committed together; a refusal rolls back.
pub(crate) async fn resolve_gap(
    unit: Unit<'_>,
    request: &GapRequest,
    mode: Mode,
) -> Result<Result<GapResolved, GapResolutionError>, Failure> {
    let facts = gap_facts(unit.client, unit.counters, unit.handler, request).await?;
    let run = decided(unit, None, |context| {
        decide_gap_resolution(request, &facts, mode, context)
    })
    .await?;
    match run {
        Run::Written(plan, report, writes) => {
            commit(unit.client, unit.counters, writes).await?;
            Ok(Ok(plan.resolved.numbered(report.resolution_id)))
        }
        Run::Refused(refusal) => {
            rollback(unit).await?;
            Ok(Err(GapResolutionError::refused(request, refusal)))
        }
        Run::Failed(error) => Err(Failure::Handler(error)),
    }
}
