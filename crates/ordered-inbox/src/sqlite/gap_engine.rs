//! A gap resolution's unit of the SQLite writer: its facts read, the core's decision, the audit
//! row written and the held successors drained through the handler, as any decision's plan.

use super::engine::{Run, Unit, decided};
use super::gaps::{GapRead, gap_facts};
use super::store::StoreError;
use crate::error::{HandlerError, InboxError};
use crate::gaps::{GapRequest, GapResolutionError, GapResolved, decide_gap_resolution};
use crate::resolution::Mode;

/// Checks the preconditions and resolves the gap, or (dry run) reports what that would do and
/// writes nothing: the facts, the core's decision, the audit row and the drain through the
/// handler, in this unit of the writer.
pub fn resolve_gap_in(
    unit: Unit<'_, '_>,
    request: &GapRequest,
    mode: Mode,
) -> Result<GapResolved, GapResolutionError> {
    let store = |error: rusqlite::Error| GapResolutionError::Store(StoreError::from(error).into());
    let handler = |error: HandlerError| GapResolutionError::Store(InboxError::Handler(error));
    let facts = gap_facts(unit.connection, unit.handler, request).map_err(|read| match read {
        GapRead::Store(error) => store(error),
        GapRead::Handler(error) => handler(error),
    })?;
    let run = decided(unit, None, |context| {
        decide_gap_resolution(request, &facts, mode, context)
    })
    .map_err(|error| GapResolutionError::Store(error.into()))?;
    match run {
        Run::Written(plan, report) => Ok(plan.resolved.numbered(report.resolution_id)),
        Run::Refused(refusal) => Err(GapResolutionError::refused(request, refusal)),
        Run::Failed(error) => Err(handler(error)),
    }
}
