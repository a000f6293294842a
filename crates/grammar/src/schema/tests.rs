use std::sync::Arc;

use serde_json::json;

use super::*;
use crate::{Grammar, Matcher, TokenTable};

/// One token per ASCII character plus '€' and 'é', then the end token.
fn chars() -> TokenTable {
    let mut tokens: Vec<(Vec<u8>, bool)> = (0u8..128).map(|b| (vec![b], false)).collect();
    tokens.push(("€".into(), false));
    tokens.push(("é".into(), false));
    tokens.push((Vec::new(), true));
    TokenTable::new(tokens)
}

fn matcher(schema: &Value) -> Matcher {
    let text = to_gbnf(schema).unwrap();
    let grammar = Grammar::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    Matcher::new(Arc::new(grammar)).unwrap()
}

/// Whether the grammar takes `text` whole.
fn accepts(schema: &Value, text: &str) -> bool {
    let table = chars();
    let mut m = matcher(schema);
    for c in text.chars() {
        let token = if c.is_ascii() {
            c as u32
        } else if c == '€' {
            128
        } else {
            129
        };
        if m.accept(token, &table).is_err() {
            return false;
        }
    }
    m.is_complete()
}

/// A random sentence of the grammar: random allowed tokens, closing up after a while.
fn generate(schema: &Value, seed: u64) -> String {
    let table = chars();
    let mut m = matcher(schema);
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut text = String::new();
    let mut allowed = Vec::new();
    for step in 0..5000 {
        m.fill_allowed(&table, &mut allowed).unwrap();
        let end = table.len() as u32 - 1;
        if allowed[end as usize] && (step > 40 || random() % 4 == 0) {
            return text;
        }
        let mut choices: Vec<u32> = (0..table.len() as u32)
            .filter(|&t| allowed[t as usize] && t != end)
            .collect();
        if choices.is_empty() && allowed[end as usize] {
            return text;
        }
        assert!(!choices.is_empty(), "dead end after {text:?}");
        if step > 40 {
            // Close up: prefer what ends strings, numbers and containers.
            let closing: Vec<u32> = choices
                .iter()
                .copied()
                .filter(|&t| matches!(t as u8, b'"' | b'}' | b']' | b',' | b'0' | b't' | b'n' | b'f') && t < 128)
                .collect();
            if !closing.is_empty() {
                choices = closing;
            }
        }
        let token = choices[(random() % choices.len() as u64) as usize];
        m.accept(token, &table).unwrap();
        text.push_str(std::str::from_utf8(table.bytes(token).unwrap()).unwrap());
    }
    panic!("no end in sight: {text}");
}

/// A validator for the keywords the compiler supports.
fn valid(schema: &Value, value: &Value, root: &Value) -> bool {
    let Value::Object(s) = schema else {
        return schema != &Value::Bool(false);
    };
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        return valid(root.pointer(&r[1..]).unwrap(), value, root);
    }
    if let Some(c) = s.get("const") {
        return c == value;
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        return e.contains(value);
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(branches) = s.get(key).and_then(Value::as_array) {
            return branches.iter().any(|b| valid(&merge_siblings(s, b, key), value, root));
        }
    }
    let types: Vec<&str> = match s.get("type") {
        Some(Value::String(t)) => vec![t],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    let type_ok = types.is_empty()
        || types.iter().any(|t| match *t {
            "string" => value.is_string(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            "boolean" => value.is_boolean(),
            "null" => value.is_null(),
            "object" => value.is_object(),
            "array" => value.is_array(),
            _ => false,
        });
    if !type_ok {
        return false;
    }
    let n = |k: &str| s.get(k).and_then(Value::as_u64).map(|n| n as usize);
    match value {
        Value::String(text) => {
            let len = text.chars().count();
            n("minLength").is_none_or(|m| len >= m) && n("maxLength").is_none_or(|m| len <= m)
        }
        Value::Array(items) => {
            if let Some(prefix) = s.get("prefixItems").and_then(Value::as_array) {
                return prefix.len() == items.len() && prefix.iter().zip(items).all(|(p, v)| valid(p, v, root));
            }
            let lengths =
                n("minItems").is_none_or(|m| items.len() >= m) && n("maxItems").is_none_or(|m| items.len() <= m);
            let each = s.get("items").is_none_or(|i| items.iter().all(|v| valid(i, v, root)));
            lengths && each
        }
        Value::Object(map) => {
            let empty = Map::new();
            let props = s.get("properties").and_then(Value::as_object).unwrap_or(&empty);
            let required = s.get("required").and_then(Value::as_array).cloned().unwrap_or_default();
            required.iter().all(|r| map.contains_key(r.as_str().unwrap()))
                && map.iter().all(|(k, v)| match props.get(k) {
                    Some(p) => valid(p, v, root),
                    None => match s.get("additionalProperties") {
                        Some(Value::Bool(false)) => false,
                        Some(Value::Bool(true)) | None => true,
                        Some(a) => valid(a, v, root),
                    },
                })
        }
        _ => true,
    }
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b\"c"]}, "minItems": 1, "maxItems": 3},
            "score": {"type": ["number", "null"]},
            "ok": {"type": "boolean"}},
            "required": ["name", "age", "tags", "score", "ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"a": {"const": 5}, "b": {"type": "string"}, "c": {"type": "null"}},
            "additionalProperties": false}),
        json!({"$defs": {"node": {"type": "object", "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                "required": ["value", "children"], "additionalProperties": false}},
            "$ref": "#/$defs/node"}),
        json!({"anyOf": [{"type": "string", "maxLength": 3}, {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "integer"}], "items": false}]}),
        json!({"type": "object", "additionalProperties": {"type": "integer"}}),
        json!({"type": "array"}),
    ]
}

#[test]
fn random_sentences_of_each_schema_parse_and_validate() {
    for schema in schemas() {
        for seed in 0..40 {
            let text = generate(&schema, seed);
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}\n{schema}"));
            assert!(
                valid(&schema, &value, &schema),
                "{text} does not validate against {schema}"
            );
        }
    }
}

#[test]
fn valid_texts_are_taken_and_invalid_ones_refused() {
    let [person, optional, tree, any_of, map, _] = <[Value; 6]>::try_from(schemas()).unwrap();
    let ok = [
        (
            &person,
            r#"{"name": "Zoë€", "age": -12, "tags": ["a", "b\"c"], "score": 1.5e3, "ok": true}"#,
        ),
        (
            &person,
            "{\n  \"name\":\"x\",\"age\":0,\"tags\":[\"a\"],\"score\":null,\"ok\":false}",
        ),
        (&optional, "{}"),
        (&optional, r#"{"b": "x"}"#),
        (&optional, r#"{"a": 5, "c": null}"#),
        (&tree, r#"{"value": 1, "children": [{"value": 2, "children": []}]}"#),
        (&any_of, r#""abc""#),
        (&any_of, "[true, 7]"),
        (&map, r#"{"x": 1, "y": 2}"#),
    ];
    for (schema, text) in ok {
        assert!(accepts(schema, text), "{text} against {schema}");
    }
    let refused = [
        (
            &person,
            r#"{"name": "", "age": 1, "tags": ["a"], "score": 1, "ok": true}"#,
        ),
        (
            &person,
            r#"{"name": "x", "age": 1.5, "tags": ["a"], "score": 1, "ok": true}"#,
        ),
        (
            &person,
            r#"{"name": "x", "age": 1, "tags": [], "score": 1, "ok": true}"#,
        ),
        (&person, r#"{"name": "x", "age": 1, "tags": ["a"], "score": 1}"#),
        (
            &person,
            r#"{"age": 1, "name": "x", "tags": ["a"], "score": 1, "ok": true}"#,
        ),
        (
            &person,
            r#"{"name": "x", "age": 01, "tags": ["a"], "score": 1, "ok": true}"#,
        ),
        (&optional, r#"{"a": 6}"#),
        (&optional, r#"{"d": 1}"#),
        (&optional, r#"{"b": "x",}"#),
        (&tree, r#"{"value": 1, "children": [{"value": 2}]}"#),
        (&any_of, r#""abcd""#),
        (&any_of, "[true, 7, 8]"),
        (&map, r#"{"x": "1"}"#),
    ];
    for (schema, text) in refused {
        assert!(!accepts(schema, text), "{text} against {schema}");
    }
    assert!(accepts(&json!({"type": "object"}), r#"{"any": [1, {"thing": null}]}"#));
    let object = Matcher::new(Arc::new(Grammar::parse(&json_object()).unwrap())).unwrap();
    assert!(!object.allows(b'[' as u32, &chars()));
}

#[test]
fn constraints_that_cannot_be_enforced_are_refused() {
    for (schema, path, needle) in [
        (json!({"type": "string", "pattern": "^a"}), "#", "'pattern'"),
        (
            json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}),
            "#/properties/n",
            "'minimum'",
        ),
        (json!({"$ref": "https://example.com/s.json"}), "#", "local references"),
        (json!({"$ref": "#/$defs/missing"}), "#", "points at nothing"),
        (json!({"type": "object", "required": ["x"]}), "#", "not in properties"),
        (
            json!({"allOf": [{"type": "string"}, {"maxLength": 2}]}),
            "#",
            "one branch",
        ),
        (json!({"type": "thing"}), "#", "unknown type"),
        (json!(false), "#", "admits no value"),
    ] {
        match to_gbnf(&schema) {
            Err(GrammarError::Schema { path: got, message }) => {
                assert_eq!(got, path, "{schema}");
                assert!(message.contains(needle), "{schema}: {message}");
            }
            other => panic!("{schema}: {other:?}"),
        }
    }
}

#[test]
fn builder_shares_json_rules_between_schemas() {
    let mut builder = Builder::default();
    let a = builder
        .schema(&json!({"type": "object", "properties": {"x": {"type": "string"}}}), "a")
        .unwrap();
    let b = builder
        .schema(&json!({"type": "object", "properties": {"y": {"type": "string"}}}), "a")
        .unwrap();
    assert_ne!(a, b);
    let text = builder.finish(&format!("{} | {}", literal("<x>") + " " + &a, b));
    Grammar::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(text.matches("\nstring ::=").count(), 1, "{text}");
}

/// A chain of `$ref`s, each defined by the next, once overflowed the stack of the
/// thread compiling it: the nesting limit started again at every reference.
#[test]
fn a_chain_of_refs_is_refused_at_the_depth_limit_not_by_the_stack() {
    let n = 50_000;
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}));
    }
    defs.insert(format!("d{n}"), json!({"type": "null"}));
    let schema = json!({"$ref": "#/$defs/d0", "$defs": defs});
    // A small stack, as a server's worker threads have: the refusal needs little.
    let err = std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || to_gbnf(&schema).unwrap_err())
        .unwrap()
        .join()
        .unwrap();
    assert!(
        err.to_string()
            .contains(&format!("nested more than {MAX_DEPTH} levels deep")),
        "{err}"
    );
    // A chain within the limit still compiles.
    let schema = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "null"}}});
    assert!(accepts(&schema, "null"));
}

/// `anyOf` branches with sibling `properties` fold the siblings into every branch: N
/// branches and M properties once compiled about 3·N·M rules before any size check.
#[test]
fn branches_times_sibling_properties_are_bounded_in_total_work() {
    let properties: serde_json::Map<String, Value> = (0..400)
        .map(|i| (format!("p{i}"), json!({"type": "integer"})))
        .collect();
    let branches: Vec<Value> = (0..400).map(|_| json!({"type": "object"})).collect();
    let schema = json!({"anyOf": branches, "properties": properties});
    // Refused by whichever bound it reaches first: rule text here.
    let err = to_gbnf(&schema).unwrap_err();
    assert_eq!(
        err,
        GrammarError::TooLarge(format!(
            "the schema compiles to more than {} bytes of grammar",
            crate::gbnf::MAX_TEXT
        ))
    );
    // Copies of siblings that compile to nothing still count: 2,000 branches folding
    // in a sibling of 100 values each is 200,000 values copied.
    let big: Vec<Value> = (0..100).map(|i| json!(i)).collect();
    let branches: Vec<Value> = (0..2000).map(|_| json!({"type": "integer"})).collect();
    let schema = json!({"anyOf": branches, "prefixItems": big});
    let err = to_gbnf(&schema).unwrap_err();
    assert_eq!(
        err,
        GrammarError::TooLarge(format!("the schema takes more than {MAX_WORK} steps to compile"))
    );
    // The budget counts across the schemas of one builder (all the tools of a request).
    let mut builder = Builder::default();
    let one: serde_json::Map<String, Value> = (0..1000)
        .map(|i| (format!("p{i}"), json!({"type": "integer"})))
        .collect();
    let tool = json!({"type": "object", "properties": one});
    let refused = (0..200)
        .map(|i| builder.schema(&tool, &format!("tool{i}")))
        .find_map(Result::err);
    assert!(matches!(refused, Some(GrammarError::TooLarge(_))), "{refused:?}");
}
