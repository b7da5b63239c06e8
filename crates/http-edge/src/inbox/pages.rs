//! Pages of a list, as every list route of the inbox answers them: `after` (a cursor: the `next`
//! of the previous page) and `limit` in, the items, then `next` out.

use ordered_inbox::views::{Page, PageRequest};
use serde::Serialize;
use serde_json::{Value, json};

use crate::error::AppError;

/// Rows a list answers with when the caller gives no `limit`, and the most it may ask for.
const DEFAULT_LIMIT: i64 = 100;
const MAX_LIMIT: i64 = 1000;

pub fn validate_limit(limit: Option<i64>) -> Result<i64, AppError> {
    let limit = limit.unwrap_or(DEFAULT_LIMIT);
    if (1..=MAX_LIMIT).contains(&limit) {
        Ok(limit)
    } else {
        Err(AppError::bad_request(format!(
            "limit must be from 1 to {MAX_LIMIT}"
        )))
    }
}

/// A page request from `after` (a cursor: the `next` of the previous page) and `limit`.
pub fn page_request(after: Option<i64>, limit: Option<i64>) -> Result<PageRequest, AppError> {
    let after = match after {
        None => 0,
        Some(after) if after >= 0 => after,
        Some(_) => return Err(AppError::bad_request("after must be 0 or more")),
    };
    Ok(PageRequest {
        after,
        limit: validate_limit(limit)?,
    })
}

/// One page of a list as the body shows it: the items under `name`, then `next`, the `after` of
/// the following page (null at the end), and any fields the route adds first.
pub fn page_body<T: Serialize>(mut head: Value, name: &str, page: Page<T>) -> Value {
    if let Some(body) = head.as_object_mut() {
        body.insert(name.to_owned(), json!(page.items));
        body.insert("next".to_owned(), json!(page.next));
    }
    head
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_body_ends_with_its_cursor() {
        let page = Page {
            items: vec![1, 2],
            next: Some(2),
        };
        let body = page_body(json!({"aggregateId": "a"}), "events", page);
        assert_eq!(
            body,
            json!({"aggregateId": "a", "events": [1, 2], "next": 2})
        );
    }
}
