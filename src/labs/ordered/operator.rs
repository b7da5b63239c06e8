//! An operator's authority, shared by every route an operator acts through (a dead letter's
//! resolution, a gap's, an aggregate's transfer): the bearer token checked against the active
//! operators, and the 401 that says what is missing.

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::http::credential::{Credential, credential};
use crate::http::error::AppError;
use crate::inbox::SharedInbox;

const UNAUTHORIZED_TITLE: &str = "Operator authentication required";
/// How to register the first operator, for answers given while there is none.
const ADD_HINT: &str = "production-lab operator add NAME --database PATH";

/// 401 with a `WWW-Authenticate` challenge; nothing was changed.
pub(super) fn unauthorized(detail: String) -> Response {
    crate::http::credential::unauthorized(UNAUTHORIZED_TITLE, detail)
}

/// The operator a request acts for, or the 401 that explains what is missing.
pub(super) async fn authenticate(
    inbox: &SharedInbox,
    headers: &HeaderMap,
) -> Result<String, Response> {
    let credential = credential(headers).map_err(IntoResponse::into_response)?;
    let token = credential.token().map(str::to_owned);
    let check = inbox
        .reads()
        .check_operator(token)
        .await
        .map_err(|error| AppError::from(error).into_response())?;
    if let Some(operator) = check.operator {
        return Ok(operator);
    }
    let detail = if check.active == 0 {
        format!(
            "no operator is registered yet: run `{ADD_HINT}` on the server's database file (with --inbox URL instead of --database when the inbox is in PostgreSQL), then send Authorization: Bearer TOKEN with the printed token"
        )
    } else {
        match credential {
            Credential::Missing => {
                "send Authorization: Bearer TOKEN with an operator's token".to_owned()
            }
            Credential::Unusable => {
                "the Authorization header must be Bearer TOKEN with an operator's token".to_owned()
            }
            Credential::Bearer(_) => "the token is not an active operator's token".to_owned(),
        }
    };
    Err(unauthorized(detail))
}
