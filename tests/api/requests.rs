//! Rules every route shares for the shape of a request: body size, JSON members, media type
//! and charset, unknown routes and methods.

use crate::helpers::{spawn_app, status_and_json};

/// One more byte than the server reads of any body.
const TOO_LARGE: usize = production_lab::server::MAX_REQUEST_BODY_BYTES + 1;

#[tokio::test]
async fn a_body_over_the_limit_answers_413_problem_json() {
    let app = spawn_app().await;
    for path in ["/ordered/apply", "/aggregates/acct-1/messages", "/worker"] {
        let padding = "a".repeat(TOO_LARGE);
        let body = format!(r#"{{"messageId":"m-1","padding":"{padding}"}}"#);
        let response = app.post_raw(path, "application/json", &body).await;
        assert_eq!(response.status(), 413, "{path}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
        let (_, problem) = status_and_json(response).await;
        assert_eq!(problem["status"], 413, "{path}");
        assert_eq!(problem["title"], "Content Too Large", "{path}");
    }
    assert_eq!(app.scalar("SELECT COUNT(*) FROM ordered_inbox"), 0);
}
