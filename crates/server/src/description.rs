//! `GET /openapi.json`: an OpenAPI 3.1 description of every route the router mounts,
//! written by hand (`openapi.json`) and checked against the router's table by the tests
//! below, so that neither can change without the other.

use axum::http::header;
use axum::response::IntoResponse;

const OPENAPI: &str = include_str!("openapi.json");

pub(crate) async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use super::OPENAPI;
    use crate::api::ROUTES;

    fn description() -> Value {
        serde_json::from_str(OPENAPI).expect("openapi.json is not JSON")
    }

    /// `$ref`s that point nowhere, anywhere in `value`.
    fn dangling_refs(root: &Value, value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(target)) = map.get("$ref") {
                    let found = target.strip_prefix('#').and_then(|pointer| root.pointer(pointer));
                    if found.is_none() {
                        out.push(target.clone());
                    }
                }
                map.values().for_each(|v| dangling_refs(root, v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| dangling_refs(root, v, out)),
            _ => {}
        }
    }

    #[test]
    fn the_description_parses_as_openapi_3_1_and_every_ref_resolves() {
        let doc = description();
        assert_eq!(doc["openapi"].as_str(), Some("3.1.0"));
        assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
        let mut dangling = Vec::new();
        dangling_refs(&doc, &doc, &mut dangling);
        assert!(dangling.is_empty(), "references to nothing: {dangling:?}");
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, operation) in item.as_object().expect("a path item") {
                let responses = operation["responses"].as_object();
                assert!(
                    responses.is_some_and(|r| r.contains_key("200")),
                    "{method} {path} describes no 200 answer"
                );
            }
        }
    }

    #[test]
    fn every_mounted_route_is_described_and_every_described_route_is_mounted() {
        let doc = description();
        let described: BTreeSet<(String, String)> = doc["paths"]
            .as_object()
            .expect("paths")
            .iter()
            .flat_map(|(path, item)| {
                item.as_object()
                    .expect("a path item")
                    .keys()
                    .map(move |method| (method.clone(), path.clone()))
            })
            .collect();
        let mounted: BTreeSet<(String, String)> = ROUTES
            .iter()
            .map(|&(method, path)| (method.to_string(), path.to_string()))
            .collect();
        let undescribed: Vec<_> = mounted.difference(&described).collect();
        let unmounted: Vec<_> = described.difference(&mounted).collect();
        assert!(
            undescribed.is_empty(),
            "mounted but not in openapi.json: {undescribed:?}"
        );
        assert!(unmounted.is_empty(), "in openapi.json but not mounted: {unmounted:?}");
    }

    /// The error answers the handlers give (`ApiError`) have the shape described.
    #[test]
    fn the_error_shape_matches_what_the_handlers_send() {
        let doc = description();
        let error = &doc["components"]["schemas"]["Error"]["properties"]["error"];
        let required: BTreeSet<&str> = error["required"]
            .as_array()
            .expect("required")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let sent = serde_json::to_value(crate::openai::ErrorBody {
            error: crate::openai::ErrorDetail {
                message: "m".into(),
                kind: "invalid_request_error",
                param: None,
                code: None,
            },
        })
        .expect("an error body");
        let keys: BTreeSet<&str> = sent["error"]
            .as_object()
            .expect("error")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(required, keys);
    }
}
