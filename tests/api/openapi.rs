//! The OpenAPI document at `GET /openapi.json`: generated from the handlers, and the router is
//! built from the same entries, so every route is documented and every documented route exists.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use reqwest::Method;
use serde_json::Value;

use crate::helpers::{TestApp, spawn_app, status_and_json};

const METHODS: [&str; 5] = ["get", "put", "post", "delete", "patch"];

async fn document(app: &TestApp) -> Value {
    let (status, document) = status_and_json(app.get("/openapi.json").await).await;
    assert_eq!(status, 200);
    document
}

/// Every documented operation: (path template, method).
fn operations(document: &Value) -> Vec<(String, String)> {
    let mut operations = Vec::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        for method in METHODS {
            if item.get(method).is_some() {
                operations.push((path.clone(), method.to_owned()));
            }
        }
    }
    operations
}

/// The template with each `{parameter}` filled: `1` for an integer, else a short word.
fn concrete(path: &str, operation: &Value) -> String {
    let mut concrete = path.to_owned();
    for parameter in operation["parameters"].as_array().into_iter().flatten() {
        if parameter["in"] != "path" {
            continue;
        }
        let name = parameter["name"].as_str().expect("a parameter name");
        let sample = if parameter["schema"]["type"] == "integer" {
            "1"
        } else {
            "x"
        };
        concrete = concrete.replace(&format!("{{{name}}}"), sample);
    }
    concrete
}

#[tokio::test]
async fn the_document_is_openapi_3_1_with_the_problem_schema_and_unique_operation_ids() {
    let app = spawn_app().await;
    let document = document(&app).await;
    assert!(
        document["openapi"]
            .as_str()
            .is_some_and(|version| version.starts_with("3.1")),
        "{}",
        document["openapi"]
    );
    let problem = &document["components"]["schemas"]["Problem"];
    for member in ["type", "title", "status", "requestId"] {
        assert!(
            problem["required"]
                .as_array()
                .is_some_and(|required| required.iter().any(|name| name == member)),
            "Problem requires {member}: {problem}"
        );
    }
    // Statuses are spelled as the bodies spell them.
    assert_eq!(
        document["components"]["schemas"]["AggregateStatus"]["enum"],
        serde_json::json!(["flowing", "waiting", "blocked"])
    );
    let mut ids = BTreeSet::new();
    for (path, method) in operations(&document) {
        let operation = &document["paths"][&path][&method];
        let id = operation["operationId"].as_str().expect("an operationId");
        assert!(ids.insert(id.to_owned()), "operationId {id} is used twice");
        let responses = operation["responses"].as_object().expect("responses");
        assert!(
            responses.contains_key("400"),
            "{method} {path} documents no 400"
        );
        // The one route that fails on purpose every time has no success to document.
        if path != "/contracts/change/{phase}" {
            assert!(
                responses.keys().any(|status| status.starts_with('2')),
                "{method} {path} documents no success"
            );
        }
    }
    // Every reference resolves inside the document.
    let text = document.to_string();
    for reference in text.split("\"$ref\":\"").skip(1) {
        let target = reference.split('"').next().unwrap_or_default();
        let pointer = target.trim_start_matches('#');
        assert!(
            document.pointer(pointer).is_some(),
            "{target} does not resolve"
        );
    }
}

#[tokio::test]
async fn every_documented_route_exists_with_exactly_its_documented_methods() {
    let app = spawn_app().await;
    let document = document(&app).await;
    let operations = operations(&document);
    assert!(operations.len() > 50, "{} operations", operations.len());

    let mut documented: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (path, method) in &operations {
        documented
            .entry(path.clone())
            .or_default()
            .insert(method.to_uppercase());
    }
    for (path, methods) in &documented {
        let item = &document["paths"][path];
        let any_operation = methods
            .iter()
            .next()
            .map(|method| &item[method.to_lowercase()])
            .expect("an operation");
        let url = app.url(&concrete(path, any_operation));
        // A method no route answers: the router names the ones it has for this path.
        let response = app
            .client
            .request(Method::from_bytes(b"BREW").expect("a method token"), &url)
            .send()
            .await
            .expect("request");
        assert_eq!(response.status(), 405, "{path} is not routed");
        let allow: BTreeSet<String> = response
            .headers()
            .get("allow")
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .split(',')
            .map(|method| method.trim().to_owned())
            .filter(|method| !method.is_empty() && method != "HEAD")
            .collect();
        assert_eq!(&allow, methods, "{path}: routed methods vs documented ones");
    }

    // The router matched each documented template itself (the route label is the template).
    let metrics = app.get("/metrics").await.text().await.expect("metrics");
    for path in documented.keys() {
        assert!(
            metrics.contains(&format!(
                "http_requests_total{{route=\"{path}\",method=\"other\""
            )),
            "{path} was not matched as a route template"
        );
    }
}

#[test]
fn no_route_is_registered_around_the_document() {
    // A route added with axum's own `route`/`nest` would be served but not documented; every
    // route goes through `utoipa_axum::routes!`, which takes its path from the annotation.
    let mut offenders = Vec::new();
    let mut pending = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(directory) = pending.pop() {
        for entry in std::fs::read_dir(&directory).expect("read src") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            if path.extension().is_none_or(|extension| extension != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read a source file");
            for (number, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or_default();
                let plain_router = code.match_indices("Router::new(").any(|(at, _)| {
                    !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_')
                });
                if plain_router
                    || [".route(", ".route_service(", ".nest(", ".nest_service("]
                        .iter()
                        .any(|call| code.contains(call))
                {
                    offenders.push(format!(
                        "{}:{}: {}",
                        path.display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "undocumented routes:\n{}",
        offenders.join("\n")
    );
}

#[tokio::test]
async fn two_labs_types_of_one_name_keep_their_own_schemas() {
    // utoipa names a component after its Rust type; a second `Counts` silently replaced the
    // messaging lab's, and the outbox's event page then promised the classroom's counts.
    let app = spawn_app().await;
    let document = document(&app).await;
    let schemas = &document["components"]["schemas"];
    let members = |name: &str| -> Vec<String> {
        schemas[name]["properties"]
            .as_object()
            .map(|properties| properties.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert_eq!(members("OutboxCounts"), ["pending", "sent"]);
    assert_eq!(members("Counts"), ["orders", "outbox", "inbox", "effects"]);
    let page = &schemas["EventPage"]["properties"]["counts"]["$ref"];
    assert_eq!(page, "#/components/schemas/OutboxCounts");
}
