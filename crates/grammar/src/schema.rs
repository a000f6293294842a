//! JSON Schema to GBNF, after llama.cpp's `json-schema-to-grammar`: every text the
//! grammar admits is JSON that validates against the schema.
//!
//! Supported: `type` (one or a list), `enum`, `const`, `properties` with `required`
//! (required properties in schema order, then optional ones in order, each optional),
//! `additionalProperties` (`false`, or a schema for an object without `properties`;
//! where extra properties are merely allowed none are generated), `items`,
//! `prefixItems`, `minItems`/`maxItems`, `minLength`/`maxLength`, `anyOf`/`oneOf`
//! (`oneOf` as `anyOf`: its branches are expected to be disjoint), `allOf` with one
//! branch, `$ref` into `#/$defs/…` or `#/definitions/…` (recursion included), and
//! annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`,
//! `strict`). Anything else that constrains values (`pattern`, `format`, `minimum`, …)
//! is refused with [`GrammarError::Schema`], never silently ignored.

use std::collections::HashMap;
use std::fmt::Write;
use std::rc::Rc;

use serde_json::{Map, Value};

use crate::GrammarError;

/// How deeply schemas may nest, counting every `$ref` followed as a level.
pub const MAX_DEPTH: usize = 64;

/// How much work compiling one grammar may take: a unit for every schema visited and
/// for every JSON value copied while folding sibling keywords into branches. A schema
/// a client sends is compiled within this bound whatever its shape (`anyOf` branches
/// times sibling `properties`, chains of `$ref`s).
pub const MAX_WORK: usize = 100_000;

/// Whitespace between tokens: bounded, so a model cannot pad forever.
const SPACE: &str = r#"space ::= | " " | "\n"{1,2} [ \t]{0,20}"#;

const PRIMITIVES: &[(&str, &str)] = &[
    ("boolean", r#"("true" | "false") space"#),
    ("null", r#""null" space"#),
    ("integral-part", r#"[0] | [1-9] [0-9]{0,15}"#),
    ("decimal-part", r#"[0-9]{1,16}"#),
    ("integer", r#"("-"? integral-part) space"#),
    (
        "number",
        // Exponents of two digits: every number fits an f64 (serde_json refuses 1e999).
        r#"("-"? integral-part) ("." decimal-part)? ([eE] [-+]? [0-9]{1,2})? space"#,
    ),
    (
        "char",
        r#"[^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})"#,
    ),
    ("string", r#""\"" char* "\"" space"#),
    ("value", r#"object | array | string | number | boolean | null"#),
    (
        "object",
        r#""{" space ( string ":" space value ("," space string ":" space value)* )? "}" space"#,
    ),
    ("array", r#""[" space ( value ("," space value)* )? "]" space"#),
];

/// A GBNF grammar whose root is any JSON object (OpenAI's `json_object` response format).
pub fn json_object() -> String {
    let mut builder = Builder::default();
    let object = builder.any_object();
    builder.finish(&object)
}

/// A GBNF grammar whose root admits exactly the JSON texts valid against `schema`.
pub fn to_gbnf(schema: &Value) -> Result<String, GrammarError> {
    let mut builder = Builder::default();
    let root = builder.schema(schema, "schema")?;
    Ok(builder.finish(&root))
}

/// Builds a grammar around JSON values of several schemas (tool calls: a name, then
/// that tool's arguments), sharing the JSON rules they have in common.
#[derive(Default)]
pub struct Builder {
    compiler: Compiler,
}

impl Builder {
    /// The rule for a value valid against `schema`; its own rules are named after `name`.
    pub fn schema(&mut self, schema: &Value, name: &str) -> Result<String, GrammarError> {
        self.compiler.root_schema = Rc::new(schema.clone());
        self.compiler.refs.clear();
        let name = self.compiler.fresh(name);
        self.compiler.visit(schema, &name, "#")
    }

    /// The rule for any JSON object.
    pub fn any_object(&mut self) -> String {
        self.compiler.need("object");
        "object".into()
    }

    /// The rule for optional whitespace.
    pub fn space(&mut self) -> String {
        self.compiler.need("space");
        "space".into()
    }

    /// Defines a rule of the caller's own (GBNF `body`), named after `hint`; returns its name.
    pub fn rule(&mut self, hint: &str, body: String) -> String {
        self.compiler.define(hint, body)
    }

    /// The whole grammar, `root ::= root_body` first.
    pub fn finish(self, root_body: &str) -> String {
        self.compiler.finish(format!("root ::= {root_body}"))
    }
}

/// GBNF for one literal string (for callers writing grammars around JSON).
pub fn literal(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[derive(Default)]
struct Compiler {
    /// Shared so that following a `$ref` reads its target in place, never copies it.
    root_schema: Rc<Value>,
    /// Rules written so far, by name.
    rules: Vec<(String, String)>,
    names: HashMap<String, usize>,
    /// `$ref` targets already given a rule (or being given one), by reference.
    refs: HashMap<String, String>,
    /// Schemas being visited, outermost first (`$ref`s followed included).
    depth: usize,
    /// Work done so far, against [`MAX_WORK`].
    work: usize,
    /// Bytes of rule text written so far, against the GBNF parser's own limit.
    bytes: usize,
}

const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "strict",
    "$defs",
    "definitions",
    "deprecated",
    "readOnly",
    "writeOnly",
];

impl Compiler {
    fn finish(mut self, root: String) -> String {
        let mut text = root;
        if !self.names.contains_key("space") && self.rules.iter().any(|(_, body)| body.contains("space")) {
            self.rules
                .push(("space".into(), SPACE.trim_start_matches("space ::= ").into()));
        }
        for (name, body) in &self.rules {
            if !text.is_empty() {
                text.push('\n');
            }
            let _ = write!(text, "{name} ::= {body}");
        }
        text
    }

    /// Adds a primitive rule (and those it uses).
    fn need(&mut self, name: &str) {
        if self.names.contains_key(name) {
            return;
        }
        if name == "space" {
            self.add("space", SPACE.trim_start_matches("space ::= ").into());
            return;
        }
        let Some((_, body)) = PRIMITIVES.iter().find(|(n, _)| *n == name) else {
            return;
        };
        self.add(name, (*body).into());
        for (other, _) in PRIMITIVES {
            if body
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .any(|w| w == *other)
            {
                self.need(other);
            }
        }
        self.need("space");
    }

    fn add(&mut self, name: &str, body: String) -> String {
        self.bytes += name.len() + body.len();
        self.names.insert(name.to_string(), self.rules.len());
        self.rules.push((name.to_string(), body));
        name.to_string()
    }

    /// A fresh rule name based on `hint`.
    fn fresh(&self, hint: &str) -> String {
        let base: String = hint
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' })
            .collect();
        let base = if base.is_empty() { "r".to_string() } else { base };
        let reserved = |name: &str| name == "root" || name == "space" || PRIMITIVES.iter().any(|(n, _)| *n == name);
        if !self.names.contains_key(&base) && !reserved(&base) {
            return base;
        }
        (1..)
            .map(|i| format!("{base}-{i}"))
            .find(|name| !self.names.contains_key(name) && !reserved(name))
            .expect("some suffix is free")
    }

    fn define(&mut self, hint: &str, body: String) -> String {
        let name = self.fresh(hint);
        self.add(&name, body)
    }

    fn unsupported<T>(path: &str, message: impl Into<String>) -> Result<T, GrammarError> {
        Err(GrammarError::Schema {
            path: path.to_string(),
            message: message.into(),
        })
    }

    /// Counts `units` of work, refusing the schema once the total passes [`MAX_WORK`] or
    /// the grammar written passes the parser's size limit.
    fn charge(&mut self, units: usize) -> Result<(), GrammarError> {
        self.work += units;
        if self.work > MAX_WORK {
            return Err(GrammarError::TooLarge(format!(
                "the schema takes more than {MAX_WORK} steps to compile"
            )));
        }
        if self.bytes > crate::gbnf::MAX_TEXT {
            return Err(GrammarError::TooLarge(format!(
                "the schema compiles to more than {} bytes of grammar",
                crate::gbnf::MAX_TEXT
            )));
        }
        Ok(())
    }

    /// Charges one unit per JSON value in `value`, stopping as soon as the budget is
    /// spent (so measuring a huge value costs no more than the budget).
    fn charge_value(&mut self, value: &Value) -> Result<(), GrammarError> {
        self.charge(1)?;
        match value {
            Value::Array(items) => items.iter().try_for_each(|v| self.charge_value(v)),
            Value::Object(map) => map.values().try_for_each(|v| self.charge_value(v)),
            _ => Ok(()),
        }
    }

    /// An expression (a rule name, usually) for `schema`.
    fn visit(&mut self, schema: &Value, name: &str, path: &str) -> Result<String, GrammarError> {
        if self.depth >= MAX_DEPTH {
            return Self::unsupported(
                path,
                format!("nested more than {MAX_DEPTH} levels deep (each $ref followed counts as a level)"),
            );
        }
        self.charge(1)?;
        self.depth += 1;
        let result = self.visit_inner(schema, name, path);
        self.depth -= 1;
        result
    }

    fn visit_inner(&mut self, schema: &Value, name: &str, path: &str) -> Result<String, GrammarError> {
        let object = match schema {
            Value::Bool(true) => {
                self.need("value");
                return Ok("value".into());
            }
            Value::Bool(false) => return Self::unsupported(path, "the schema `false` admits no value"),
            Value::Object(object) => object,
            _ => return Self::unsupported(path, "a schema must be an object or a boolean"),
        };
        let known = [
            "type",
            "enum",
            "const",
            "properties",
            "required",
            "additionalProperties",
            "items",
            "prefixItems",
            "minItems",
            "maxItems",
            "minLength",
            "maxLength",
            "anyOf",
            "oneOf",
            "allOf",
            "$ref",
        ];
        for key in object.keys() {
            if !known.contains(&key.as_str()) && !ANNOTATIONS.contains(&key.as_str()) {
                return Self::unsupported(path, format!("the keyword '{key}' cannot be enforced"));
            }
        }
        if let Some(reference) = object.get("$ref") {
            let Some(reference) = reference.as_str() else {
                return Self::unsupported(path, "$ref must be a string");
            };
            return self.reference(reference, path);
        }
        if let Some(value) = object.get("const") {
            self.need("space");
            return Ok(self.define(name, literal(&value.to_string()) + " space"));
        }
        if let Some(values) = object.get("enum") {
            let Some(values) = values.as_array().filter(|v| !v.is_empty()) else {
                return Self::unsupported(path, "enum must be a non-empty array");
            };
            self.need("space");
            let alts: Vec<String> = values.iter().map(|v| literal(&v.to_string())).collect();
            return Ok(self.define(name, format!("({}) space", alts.join(" | "))));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(branches) = object.get(key) {
                let Some(branches) = branches.as_array().filter(|b| !b.is_empty()) else {
                    return Self::unsupported(path, format!("{key} must be a non-empty array"));
                };
                let mut alts = Vec::new();
                for (i, branch) in branches.iter().enumerate() {
                    let merged = self.merge_siblings(object, branch, key)?;
                    alts.push(self.visit(&merged, &format!("{name}-{i}"), &format!("{path}/{key}/{i}"))?);
                }
                return Ok(self.define(name, alts.join(" | ")));
            }
        }
        if let Some(all) = object.get("allOf") {
            match all.as_array().map(Vec::as_slice) {
                Some([one]) => {
                    let merged = self.merge_siblings(object, one, "allOf")?;
                    return self.visit(&merged, name, &format!("{path}/allOf/0"));
                }
                _ => return Self::unsupported(path, "allOf is supported with one branch only"),
            }
        }
        let types: Vec<&str> = match object.get("type") {
            None => {
                // Infer from the keywords present, else any value.
                if object.contains_key("properties") || object.contains_key("additionalProperties") {
                    vec!["object"]
                } else if object.contains_key("items") || object.contains_key("prefixItems") {
                    vec!["array"]
                } else if object.contains_key("minLength") || object.contains_key("maxLength") {
                    vec!["string"]
                } else {
                    self.need("value");
                    return Ok("value".into());
                }
            }
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) if !ts.is_empty() => {
                let mut types = Vec::new();
                for t in ts {
                    match t.as_str() {
                        Some(t) => types.push(t),
                        None => return Self::unsupported(path, "type must be a string or a list of strings"),
                    }
                }
                types
            }
            Some(_) => return Self::unsupported(path, "type must be a string or a list of strings"),
        };
        if types.len() > 1 {
            let mut alts = Vec::new();
            for t in types {
                self.charge_value(schema)?;
                let mut single = object.clone();
                single.insert("type".into(), Value::String(t.into()));
                alts.push(self.visit(&Value::Object(single), &format!("{name}-{t}"), path)?);
            }
            return Ok(self.define(name, alts.join(" | ")));
        }
        match types[0] {
            "string" => self.string(object, name, path),
            "integer" | "number" | "boolean" | "null" => {
                self.need(types[0]);
                Ok(types[0].into())
            }
            "object" => self.object(object, name, path),
            "array" => self.array(object, name, path),
            other => Self::unsupported(path, format!("unknown type '{other}'")),
        }
    }

    fn reference(&mut self, reference: &str, path: &str) -> Result<String, GrammarError> {
        if let Some(rule) = self.refs.get(reference) {
            return Ok(rule.clone());
        }
        let Some(pointer) = reference.strip_prefix('#') else {
            return Self::unsupported(path, format!("only local references are supported, not '{reference}'"));
        };
        let root = Rc::clone(&self.root_schema);
        let Some(target) = root.pointer(pointer) else {
            return Self::unsupported(path, format!("the reference '{reference}' points at nothing"));
        };
        let hint = format!("ref{}", pointer.rsplit('/').next().unwrap_or_default());
        // Name it first, so that a recursive reference finds it.
        let rule = self.fresh(&hint);
        self.add(&rule, String::new());
        self.refs.insert(reference.to_string(), rule.clone());
        let body = self.visit(target, &format!("{rule}-body"), reference)?;
        let index = self.names[&rule];
        self.rules[index].1 = body;
        Ok(rule)
    }

    fn string(&mut self, object: &Map<String, Value>, name: &str, path: &str) -> Result<String, GrammarError> {
        let min = count(object, "minLength", path)?;
        let max = count(object, "maxLength", path)?;
        if min.is_none() && max.is_none() {
            self.need("string");
            return Ok("string".into());
        }
        self.need("char");
        self.need("space");
        let min = min.unwrap_or(0);
        let repeat = match max {
            Some(max) if max < min => return Self::unsupported(path, "maxLength is below minLength"),
            Some(max) => format!("char{{{min},{max}}}"),
            None => format!("char{{{min},}}"),
        };
        Ok(self.define(name, format!("\"\\\"\" {repeat} \"\\\"\" space")))
    }

    fn array(&mut self, object: &Map<String, Value>, name: &str, path: &str) -> Result<String, GrammarError> {
        self.need("space");
        if let Some(prefix) = object.get("prefixItems") {
            let Some(prefix) = prefix.as_array() else {
                return Self::unsupported(path, "prefixItems must be an array");
            };
            if object.get("items").is_some_and(|i| i != &Value::Bool(false)) {
                return Self::unsupported(path, "prefixItems is supported with items: false only");
            }
            let mut parts = Vec::new();
            for (i, item) in prefix.iter().enumerate() {
                parts.push(self.visit(item, &format!("{name}-{i}"), &format!("{path}/prefixItems/{i}"))?);
            }
            let body = if parts.is_empty() {
                "\"[\" space \"]\" space".to_string()
            } else {
                format!("\"[\" space {} \"]\" space", parts.join(" \",\" space "))
            };
            return Ok(self.define(name, body));
        }
        let item = match object.get("items") {
            None => {
                self.need("value");
                "value".to_string()
            }
            Some(items) => self.visit(items, &format!("{name}-item"), &format!("{path}/items"))?,
        };
        let min = count(object, "minItems", path)?.unwrap_or(0);
        let max = count(object, "maxItems", path)?;
        if max.is_some_and(|max| max < min) {
            return Self::unsupported(path, "maxItems is below minItems");
        }
        let list = match (min, max) {
            (_, Some(0)) => String::new(),
            (0, None) => format!("( {item} (\",\" space {item})* )?"),
            (0, Some(max)) => format!("( {item} (\",\" space {item}){{0,{}}} )?", max - 1),
            (min, None) => format!("{item} (\",\" space {item}){{{},}}", min - 1),
            (min, Some(max)) => format!("{item} (\",\" space {item}){{{},{}}}", min - 1, max - 1),
        };
        Ok(self.define(name, format!("\"[\" space {list} \"]\" space")))
    }

    fn object(&mut self, object: &Map<String, Value>, name: &str, path: &str) -> Result<String, GrammarError> {
        self.need("space");
        let empty = Map::new();
        let properties = match object.get("properties") {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(_) => return Self::unsupported(path, "properties must be an object"),
        };
        let required: Vec<&str> = match object.get("required") {
            None => Vec::new(),
            Some(Value::Array(r)) => r.iter().filter_map(Value::as_str).collect(),
            Some(_) => return Self::unsupported(path, "required must be an array of names"),
        };
        if let Some(missing) = required.iter().find(|r| !properties.contains_key(**r)) {
            return Self::unsupported(path, format!("required property '{missing}' is not in properties"));
        }
        let additional = object.get("additionalProperties");
        if properties.is_empty() {
            let value = match additional {
                Some(Value::Bool(false)) => return Ok(self.define(name, "\"{\" space \"}\" space".into())),
                None | Some(Value::Bool(true)) => {
                    self.need("object");
                    return Ok("object".into());
                }
                Some(schema) => self.visit(
                    schema,
                    &format!("{name}-value"),
                    &format!("{path}/additionalProperties"),
                )?,
            };
            self.need("string");
            let body = format!(
                "\"{{\" space ( string \":\" space {value} (\",\" space string \":\" space {value})* )? \"}}\" space"
            );
            return Ok(self.define(name, body));
        }
        if additional.is_some_and(|a| !matches!(a, Value::Bool(_))) {
            return Self::unsupported(
                path,
                "additionalProperties as a schema is supported only without properties",
            );
        }
        let mut pairs = Vec::new();
        for (key, schema) in properties {
            let value = self.visit(schema, &format!("{name}-{key}"), &format!("{path}/properties/{key}"))?;
            let pair = format!(
                "{} space \":\" space {value}",
                literal(&Value::String(key.clone()).to_string())
            );
            pairs.push((key.as_str(), self.define(&format!("{name}-{key}-kv"), pair)));
        }
        let required_pairs: Vec<&String> = required
            .iter()
            .filter_map(|r| pairs.iter().find(|(k, _)| k == r).map(|(_, p)| p))
            .collect();
        let optional: Vec<&String> = pairs
            .iter()
            .filter(|(k, _)| !required.contains(k))
            .map(|(_, p)| p)
            .collect();
        // after(i): optional properties from i on, something already written.
        // first(i): the same, nothing written yet.
        let mut after = String::new();
        let mut first = String::new();
        for (i, pair) in optional.iter().enumerate().rev() {
            let after_rest = if after.is_empty() {
                String::new()
            } else {
                format!(" {after}")
            };
            let after_body = format!("(\",\" space {pair})?{after_rest}");
            let new_after = self.define(&format!("{name}-after-{i}"), after_body);
            let first_body = if first.is_empty() {
                format!("{pair}{after_rest} | ")
            } else {
                format!("{pair}{after_rest} | {first}")
            };
            first = self.define(&format!("{name}-first-{i}"), first_body);
            after = new_after;
        }
        let inside = if required_pairs.is_empty() {
            first
        } else {
            let mut seq = required_pairs
                .iter()
                .map(|p| p.as_str())
                .collect::<Vec<_>>()
                .join(" \",\" space ");
            if !after.is_empty() {
                seq.push(' ');
                seq.push_str(&after);
            }
            seq
        };
        Ok(self.define(name, format!("\"{{\" space {inside} \"}}\" space")))
    }

    /// [`merge_siblings`], every value it copies charged as work first.
    fn merge_siblings(
        &mut self,
        object: &Map<String, Value>,
        branch: &Value,
        key: &str,
    ) -> Result<Value, GrammarError> {
        self.charge_value(branch)?;
        if branch.is_object() {
            for (k, v) in object {
                if k != key && !ANNOTATIONS.contains(&k.as_str()) {
                    self.charge_value(v)?;
                }
            }
        }
        Ok(merge_siblings(object, branch, key))
    }
}

/// A branch of `anyOf`/`oneOf`/`allOf` with the keywords written beside it (e.g. a
/// shared `type`) folded in.
fn merge_siblings(object: &Map<String, Value>, branch: &Value, key: &str) -> Value {
    let Value::Object(branch) = branch else {
        return branch.clone();
    };
    let mut merged = branch.clone();
    for (k, v) in object {
        if k != key && !ANNOTATIONS.contains(&k.as_str()) && !merged.contains_key(k) {
            merged.insert(k.clone(), v.clone());
        }
    }
    Value::Object(merged)
}

fn count(object: &Map<String, Value>, key: &str, path: &str) -> Result<Option<u32>, GrammarError> {
    match object.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= 1000 => Ok(Some(n as u32)),
            _ => Compiler::unsupported(path, format!("{key} must be an integer from 0 to 1000")),
        },
    }
}

#[cfg(test)]
mod tests;
