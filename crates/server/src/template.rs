//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with minijinja
//! the way Hugging Face transformers and llama.cpp's server render it.
//!
//! Templates are written for Python's Jinja2 plus a few globals that transformers adds,
//! so the environment mirrors that one: `trim_blocks` and `lstrip_blocks` on,
//! `keep_trailing_newline` off, `{% break %}`/`{% continue %}`, Python string, list and
//! dict methods (`.strip()`, `.items()`, …), `raise_exception(msg)`, `strftime_now(fmt)`
//! and a `tojson` filter that writes what Python's `json.dumps` writes (transformers'
//! own filter), not minijinja's HTML-safe compact JSON.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{context, Environment, ErrorKind, Value};

/// Name the template is registered under; it shows in error locations.
const TEMPLATE_NAME: &str = "chat_template";

/// One chat message as templates see it (the fields Hugging Face templates read).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool` (or whatever role the template knows).
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant's calls, `{"id", "type", "function": {"name", "arguments"}}` with
    /// `arguments` as a JSON object (what templates `tojson`), not OpenAI's string.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool result: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result: the function's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

/// Why a chat template could not be compiled or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template source is not valid (mini)Jinja.
    #[error("chat template does not compile: {message}")]
    Compile {
        /// minijinja's description, with the line.
        message: String,
    },
    /// The template called `raise_exception(message)`: it rejects this conversation
    /// (for example roles that do not alternate). A client error.
    #[error("chat template rejected the conversation: {message}")]
    Raised {
        /// The text the template passed to `raise_exception`.
        message: String,
    },
    /// Rendering failed for another reason (an unsupported filter, a bad operation).
    #[error("chat template failed to render: {message}")]
    Render {
        /// minijinja's description, with the line and any underlying cause.
        message: String,
    },
}

/// The template used when a GGUF has none: ChatML, as llama.cpp falls back to.
///
/// Each message renders as `<|im_start|>{role}\n{content}<|im_end|>\n`; with
/// `add_generation_prompt` the prompt ends with `<|im_start|>assistant\n`. No system
/// prompt is added and `bos_token`/`eos_token` are not used.
pub const DEFAULT_TEMPLATE: &str = r#"{%- for message in messages -%}
  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}"#;

/// A compiled chat template with the model's BOS/EOS text, ready to render prompts.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    renders_tools: bool,
    bos_token: String,
    eos_token: String,
    is_default: bool,
}

/// Instructions one render may execute (minijinja's fuel).
const TEMPLATE_FUEL: u64 = 20_000_000;

impl ChatTemplate {
    /// `source`: the GGUF's tokenizer.chat_template, or None for DEFAULT_TEMPLATE.
    /// `bos_token`/`eos_token` are the texts of those tokens, passed to the template.
    pub fn new(source: Option<&str>, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        // transformers builds its Jinja2 environment with these two on; llama.cpp copies it.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // The template comes from the model file: a hostile one must not spin a render
        // thread forever (issue 16). Real templates take a few thousand instructions per
        // message; fuel runs out after a second or so of work.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", json::tojson);
        env.add_template_owned(TEMPLATE_NAME, source.unwrap_or(DEFAULT_TEMPLATE).to_owned())
            .map_err(|err| TemplateError::Compile {
                message: describe(&err),
            })?;
        let is_default = source.is_none();
        let source = source.unwrap_or(DEFAULT_TEMPLATE).to_owned();
        Ok(ChatTemplate {
            env,
            renders_tools: source.contains("tools"),
            source,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            is_default,
        })
    }

    /// Renders `messages`; `add_generation_prompt` appends the assistant turn opener.
    ///
    /// The output is text, special tokens included as text (e.g. `<|im_start|>`): tokenize
    /// it with special-token parsing. Templates that start with `bos_token` duplicate the
    /// BOS a tokenizer adds itself; llama.cpp strips it, see [`ChatTemplate::bos_token`].
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders `messages` with `tools` (OpenAI's tool objects, passed to the template as
    /// transformers passes them: the template decides how the model sees them).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with_kwargs(messages, tools, &serde_json::Map::new(), add_generation_prompt)
    }

    /// Renders as [`ChatTemplate::render_with_tools`] with `kwargs` as further
    /// variables (llama.cpp's `chat_template_kwargs`: `enable_thinking`,
    /// `reasoning_effort`); they cannot replace the messages, tools or special tokens.
    pub fn render_with_kwargs(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|err| TemplateError::Render {
                message: describe(&err),
            })?;
        // Without tools `tools` is none, as transformers passes it; templates test `if tools`.
        let tools = tools.map_or(Value::from(()), Value::from_serialize);
        let variables = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => tools,
            ..Value::from_serialize(kwargs)
        };
        template.render(variables).map_err(|err| match raised_message(&err) {
            Some(message) => TemplateError::Raised { message },
            None => TemplateError::Render {
                message: describe(&err),
            },
        })
    }

    /// Whether the template shows the model `tools` (else the server describes them in
    /// a system message).
    pub fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template came from the model (false: the default).
    pub fn is_default(&self) -> bool {
        self.is_default
    }

    /// The BOS text the template sees as `bos_token`.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The EOS text the template sees as `eos_token`.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("is_default", &self.is_default)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// minijinja's message plus the chain of causes behind it.
fn describe(err: &minijinja::Error) -> String {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

/// Marks an error as coming from the template's own `raise_exception` call.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// The text a template passed to `raise_exception`, if that is what failed.
fn raised_message(err: &minijinja::Error) -> Option<String> {
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if let Some(raised) = cause.downcast_ref::<RaisedByTemplate>() {
            return Some(raised.0.clone());
        }
        source = cause.source();
    }
    None
}

/// `raise_exception(message)`: transformers' way for a template to refuse a conversation.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedByTemplate(message)))
}

/// `strftime_now(format)`: the current time formatted like Python's `strftime`.
///
/// UTC, not local time as in transformers and llama.cpp: a server's local zone means
/// nothing to its clients, and reading it portably needs a time-zone database.
fn strftime_now(format: &str) -> String {
    // A clock before 1970 is not worth an error: it renders as the epoch.
    let unix_seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    strftime::format(format, &strftime::UtcDateTime::from_unix_seconds(unix_seconds as i64))
}

/// Python-style `strftime` over UTC (C locale), without a date-time dependency.
mod strftime {
    use std::fmt::Write;

    const WEEKDAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    /// Days before the first of each month in a non-leap year.
    const DAYS_BEFORE_MONTH: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];

    /// A broken-down UTC time.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) struct UtcDateTime {
        pub year: i64,
        /// 1..=12
        pub month: u32,
        /// 1..=31
        pub day: u32,
        pub hour: u32,
        pub minute: u32,
        pub second: u32,
        /// 0 = Sunday.
        pub weekday: u32,
        /// 1..=366
        pub day_of_year: u32,
    }

    impl UtcDateTime {
        /// Seconds since 1970-01-01T00:00:00Z broken down (proleptic Gregorian calendar).
        pub fn from_unix_seconds(unix_seconds: i64) -> UtcDateTime {
            let days = unix_seconds.div_euclid(86_400);
            let second_of_day = unix_seconds.rem_euclid(86_400) as u32;
            // Howard Hinnant's civil_from_days: eras of 400 years starting on March 1st.
            let shifted = days + 719_468;
            let era = shifted.div_euclid(146_097);
            let day_of_era = shifted.rem_euclid(146_097);
            let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
            let day_of_march_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
            let march_month = (5 * day_of_march_year + 2) / 153;
            let day = (day_of_march_year - (153 * march_month + 2) / 5 + 1) as u32;
            let month = if march_month < 10 {
                march_month + 3
            } else {
                march_month - 9
            } as u32;
            let year = year_of_era + era * 400 + i64::from(month <= 2);
            let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
            let day_of_year = DAYS_BEFORE_MONTH[month as usize - 1] + u32::from(leap && month > 2) + day;
            UtcDateTime {
                year,
                month,
                day,
                hour: second_of_day / 3600,
                minute: second_of_day / 60 % 60,
                second: second_of_day % 60,
                // 1970-01-01 was a Thursday.
                weekday: (days + 4).rem_euclid(7) as u32,
                day_of_year,
            }
        }
    }

    /// Formats `time` by `format` as C's `strftime` does in the C locale, plus glibc's
    /// `%-d` (no padding). Unknown directives are copied through unchanged.
    pub(super) fn format(format: &str, time: &UtcDateTime) -> String {
        let mut out = String::with_capacity(format.len() + 16);
        let mut chars = format.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let mut directive = chars.next();
            let unpadded = directive == Some('-');
            if unpadded {
                directive = chars.next();
            }
            let Some(directive) = directive else {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                break;
            };
            let number = |out: &mut String, value: i64, width: usize| {
                let _ = if unpadded {
                    write!(out, "{value}")
                } else {
                    write!(out, "{value:0width$}")
                };
            };
            let hour12 = match time.hour % 12 {
                0 => 12,
                hour => hour,
            };
            match directive {
                'a' => out.push_str(&WEEKDAYS[time.weekday as usize][..3]),
                'A' => out.push_str(WEEKDAYS[time.weekday as usize]),
                'b' | 'h' => out.push_str(&MONTHS[time.month as usize - 1][..3]),
                'B' => out.push_str(MONTHS[time.month as usize - 1]),
                'c' => out.push_str(&self::format("%a %b %e %H:%M:%S %Y", time)),
                'd' => number(&mut out, time.day.into(), 2),
                'D' | 'x' => out.push_str(&self::format("%m/%d/%y", time)),
                'e' => {
                    let _ = if unpadded {
                        write!(out, "{}", time.day)
                    } else {
                        write!(out, "{:2}", time.day)
                    };
                }
                'F' => out.push_str(&self::format("%Y-%m-%d", time)),
                'H' => number(&mut out, time.hour.into(), 2),
                'I' => number(&mut out, hour12.into(), 2),
                'j' => number(&mut out, time.day_of_year.into(), 3),
                'm' => number(&mut out, time.month.into(), 2),
                'M' => number(&mut out, time.minute.into(), 2),
                'n' => out.push('\n'),
                'p' => out.push_str(if time.hour < 12 { "AM" } else { "PM" }),
                'R' => out.push_str(&self::format("%H:%M", time)),
                'S' => number(&mut out, time.second.into(), 2),
                't' => out.push('\t'),
                'T' | 'X' => out.push_str(&self::format("%H:%M:%S", time)),
                'u' => number(&mut out, if time.weekday == 0 { 7 } else { time.weekday.into() }, 1),
                'w' => number(&mut out, time.weekday.into(), 1),
                'y' => number(&mut out, time.year.rem_euclid(100), 2),
                'Y' => {
                    let _ = write!(out, "{}", time.year);
                }
                'z' => out.push_str("+0000"),
                'Z' => out.push_str("UTC"),
                '%' => out.push('%'),
                other => {
                    out.push('%');
                    if unpadded {
                        out.push('-');
                    }
                    out.push(other);
                }
            }
        }
        out
    }
}

/// The `tojson` filter as transformers defines it: Python's
/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
///
/// This matters for tool-calling templates: Python writes `{"a": 1, "b": 2}` (spaces
/// after `,` and `:`) and leaves `<`, `'` and non-ASCII alone, where minijinja's built-in
/// filter writes compact, HTML-escaped JSON the model never saw in training.
mod json {
    use minijinja::value::{Kwargs, Rest, ValueKind};
    use minijinja::{Error, ErrorKind, Value};

    /// Nesting deeper than this is refused (namespaces can contain themselves).
    const MAX_DEPTH: usize = 128;
    /// A larger indent is surely a mistake; refusing it bounds the output.
    const MAX_INDENT: usize = 256;
    /// transformers' positional order (llama.cpp follows it).
    const PARAMETERS: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];

    /// How to write JSON: json.dumps's options.
    struct Style {
        ensure_ascii: bool,
        indent: Option<String>,
        item_separator: String,
        key_separator: String,
        sort_keys: bool,
    }

    fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidOperation, message.into())
    }

    /// `value | tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
    pub(super) fn tojson(value: &Value, positional: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
        if positional.len() > PARAMETERS.len() {
            return Err(Error::new(
                ErrorKind::TooManyArguments,
                "tojson takes at most 4 arguments",
            ));
        }
        let mut options: [Option<Value>; 4] = Default::default();
        for (index, name) in PARAMETERS.iter().enumerate() {
            let keyword: Option<Value> = kwargs.get(name)?;
            options[index] = match (positional.get(index), keyword) {
                (Some(_), Some(_)) => return Err(invalid(format!("tojson got multiple values for {name}"))),
                (Some(value), None) => Some(value.clone()),
                (None, keyword) => keyword,
            };
        }
        kwargs.assert_all_used()?;
        let [ensure_ascii, indent, separators, sort_keys] = options;
        let indent = indent
            .filter(|value| !value.is_none() && !value.is_undefined())
            .map(indent_text)
            .transpose()?;
        let (item_separator, key_separator) = match separators.filter(|value| !value.is_none()) {
            Some(separators) => separator_pair(&separators)?,
            // json.dumps drops the space after ',' when indenting: lines would end with it.
            None => (if indent.is_some() { "," } else { ", " }.to_owned(), ": ".to_owned()),
        };
        let style = Style {
            ensure_ascii: ensure_ascii.is_some_and(|value| value.is_true()),
            indent,
            item_separator,
            key_separator,
            sort_keys: sort_keys.is_some_and(|value| value.is_true()),
        };
        let mut out = String::new();
        write_value(&mut out, value, &style, 0)?;
        Ok(out)
    }

    /// Python's indent: a number of spaces (bools count as 0/1), or the string itself.
    fn indent_text(indent: Value) -> Result<String, Error> {
        if let Some(text) = indent.as_str() {
            return Ok(text.to_owned());
        }
        let spaces = match indent.kind() {
            ValueKind::Bool => i64::from(indent.is_true()),
            _ => indent
                .as_i64()
                .ok_or_else(|| invalid("tojson indent must be an integer or a string"))?,
        };
        let spaces = usize::try_from(spaces).unwrap_or(0);
        if spaces > MAX_INDENT {
            return Err(invalid(format!("tojson indent {spaces} is larger than {MAX_INDENT}")));
        }
        Ok(" ".repeat(spaces))
    }

    fn separator_pair(separators: &Value) -> Result<(String, String), Error> {
        let error = || invalid("tojson separators must be two strings (item_separator, key_separator)");
        let items: Vec<Value> = separators.try_iter().map_err(|_| error())?.collect();
        match items.as_slice() {
            [item, key] => match (item.as_str(), key.as_str()) {
                (Some(item), Some(key)) => Ok((item.to_owned(), key.to_owned())),
                _ => Err(error()),
            },
            _ => Err(error()),
        }
    }

    fn write_value(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
        if depth > MAX_DEPTH {
            return Err(invalid(format!("tojson: value nested deeper than {MAX_DEPTH} levels")));
        }
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&number_text(value)?),
            ValueKind::String => write_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                write_container(out, ('[', ']'), items.len(), style, depth, |out, index| {
                    write_value(out, &items[index], style, depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((key_text(&key)?, item));
                }
                if style.sort_keys {
                    entries.sort_by(|left, right| left.0.cmp(&right.0));
                }
                write_container(out, ('{', '}'), entries.len(), style, depth, |out, index| {
                    let (key, item) = &entries[index];
                    write_string(out, key, style.ensure_ascii);
                    out.push_str(&style.key_separator);
                    write_value(out, item, style, depth + 1)
                })?;
            }
            _ => return Err(invalid(format!("tojson cannot serialize {} values", value.kind()))),
        }
        Ok(())
    }

    /// Writes `[a, b]` / `{..}` with json.dumps's layout; empty containers stay `[]`/`{}`.
    fn write_container(
        out: &mut String,
        (open, close): (char, char),
        len: usize,
        style: &Style,
        depth: usize,
        mut write_item: impl FnMut(&mut String, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if len > 0 {
            for index in 0..len {
                if index > 0 {
                    out.push_str(&style.item_separator);
                }
                if let Some(indent) = &style.indent {
                    out.push('\n');
                    out.push_str(&indent.repeat(depth + 1));
                }
                write_item(out, index)?;
            }
            if let Some(indent) = &style.indent {
                out.push('\n');
                out.push_str(&indent.repeat(depth));
            }
        }
        out.push(close);
        Ok(())
    }

    /// json.dumps turns non-string keys into strings: `1` → `"1"`, `True` → `"true"`.
    fn key_text(key: &Value) -> Result<String, Error> {
        match key.kind() {
            ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
            ValueKind::Number => number_text(key),
            ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
            ValueKind::None | ValueKind::Undefined => Ok("null".to_owned()),
            kind => Err(invalid(format!(
                "tojson: keys must be strings, numbers, booleans or none, not {kind}"
            ))),
        }
    }

    fn number_text(number: &Value) -> Result<String, Error> {
        if number.is_integer() {
            return Ok(number.to_string());
        }
        let float = f64::try_from(number.clone())?;
        Ok(python_float_repr(float))
    }

    /// Python's `repr(float)` (what json.dumps writes): shortest round-trip digits,
    /// positional for exponents -4..16, else `1e+16` style; `NaN`/`Infinity` as Python.
    pub(super) fn python_float_repr(float: f64) -> String {
        if float.is_nan() {
            return "NaN".to_owned();
        }
        if float.is_infinite() {
            return if float > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
        }
        // Rust's `{:e}` is also shortest round-trip: "1.2345e3", "-1e-7", "0e0".
        let scientific = format!("{float:e}");
        let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
        let exponent: i32 = exponent.parse().unwrap_or(0);
        let sign = if mantissa.starts_with('-') { "-" } else { "" };
        let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
        if (-4..16).contains(&exponent) {
            if exponent < 0 {
                let zeros = "0".repeat((-exponent - 1) as usize);
                format!("{sign}0.{zeros}{digits}")
            } else {
                let integer_digits = exponent as usize + 1;
                if digits.len() <= integer_digits {
                    let zeros = "0".repeat(integer_digits - digits.len());
                    format!("{sign}{digits}{zeros}.0")
                } else {
                    let (integer, fraction) = digits.split_at(integer_digits);
                    format!("{sign}{integer}.{fraction}")
                }
            }
        } else {
            let (first, rest) = digits.split_at(1);
            let fraction = if rest.is_empty() {
                String::new()
            } else {
                format!(".{rest}")
            };
            let exponent_sign = if exponent < 0 { '-' } else { '+' };
            format!("{sign}{first}{fraction}e{exponent_sign}{:02}", exponent.unsigned_abs())
        }
    }

    /// A JSON string literal as json.dumps writes it.
    fn write_string(out: &mut String, text: &str, ensure_ascii: bool) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if c < ' ' || (ensure_ascii && c > '~') => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const QWEN_MODEL: &str = "/work/main/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
    const GEMMA_MODEL: &str = "/work/main/models/gemma-3-270m-q4_k_m.gguf";

    /// google/gemma-3-270m-it's `chat_template` (tokenizer_config.json), verbatim. The
    /// GGUF under test is the base model and embeds no template, see
    /// `gemma3_gguf_has_no_template_and_falls_back_to_chatml`.
    const GEMMA3_IT_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"#;

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "You are terse."),
            ChatMessage::new("user", "What is 2+2?"),
            ChatMessage::new("assistant", "4\n"),
            ChatMessage::new("user", "And 3+3?"),
        ]
    }

    fn model_template(path: &str) -> Option<String> {
        baton_ggml::LlamaModel::load_vocab(Path::new(path))
            .expect("test model loads")
            .chat_template()
    }

    fn render_source(source: &str, messages: &[ChatMessage]) -> Result<String, TemplateError> {
        ChatTemplate::new(Some(source), "<s>", "</s>")?.render(messages, false)
    }

    #[test]
    fn default_template_renders_chatml() {
        let template = ChatTemplate::new(None, "", "").unwrap();
        assert!(template.is_default());
        let messages = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi there"),
        ];
        let without_prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n";
        assert_eq!(template.render(&messages, false).unwrap(), without_prompt);
        assert_eq!(
            template.render(&messages, true).unwrap(),
            format!("{without_prompt}<|im_start|>assistant\n")
        );
        assert_eq!(template.render(&[], true).unwrap(), "<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_surfaces_its_message() {
        let source =
            "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}";
        let err = render_source(source, &conversation()).unwrap_err();
        match &err {
            TemplateError::Raised { message } => assert_eq!(message, "System role not supported"),
            other => panic!("expected Raised, got {other:?}"),
        }
        assert!(err.to_string().contains("System role not supported"));
    }

    #[test]
    fn broken_templates_fail_to_compile() {
        for source in [
            "{% for message in messages %}",
            "{{ messages[0] ",
            "{% endif %}",
            "{% if %}x{% endif %}",
        ] {
            match ChatTemplate::new(Some(source), "", "") {
                Err(TemplateError::Compile { message }) => assert!(message.contains("syntax error"), "{message}"),
                other => panic!("{source:?}: expected a compile error, got {other:?}"),
            }
        }
    }

    /// Issue 16: a model file's template that loops without end is stopped, with an
    /// error, instead of holding a render thread; a long real conversation still renders.
    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let source = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        let started = std::time::Instant::now();
        let err = render_source(source, &conversation()).unwrap_err();
        assert!(
            matches!(err, TemplateError::Render { ref message } if message.contains("fuel")),
            "{err:?}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
        let long: Vec<ChatMessage> = (0..2000)
            .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "a turn of a long chat"))
            .collect();
        let source = model_template(QWEN_MODEL).unwrap();
        let rendered = ChatTemplate::new(Some(&source), "", "<|im_end|>")
            .unwrap()
            .render(&long, true)
            .unwrap();
        assert_eq!(rendered.matches("a turn of a long chat").count(), 2000);
    }

    #[test]
    fn other_render_failures_are_render_errors() {
        let err = render_source("{{ messages | no_such_filter }}", &conversation()).unwrap_err();
        assert!(
            matches!(err, TemplateError::Render { ref message } if message.contains("no_such_filter")),
            "{err:?}"
        );
    }

    #[test]
    fn qwen25_real_template() {
        let source = model_template(QWEN_MODEL).expect("Qwen2.5 GGUF embeds a chat template");
        let template = ChatTemplate::new(Some(&source), "", "<|im_end|>").unwrap();
        assert!(!template.is_default());
        assert_eq!(
            template.render(&conversation(), true).unwrap(),
            "<|im_start|>system\nYou are terse.<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n4\n<|im_end|>\n\
             <|im_start|>user\nAnd 3+3?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        // Without a system message the template supplies its own.
        assert_eq!(
            template.render(&[ChatMessage::new("user", "Hi")], true).unwrap(),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn gemma3_gguf_has_no_template_and_falls_back_to_chatml() {
        let source = model_template(GEMMA_MODEL);
        assert_eq!(
            source, None,
            "gemma-3-270m (base) GGUF gained a chat template: test it like Qwen's"
        );
        let template = ChatTemplate::new(source.as_deref(), "<bos>", "<eos>").unwrap();
        assert!(template.is_default());
        assert_eq!(
            template.render(&conversation()[1..2], true).unwrap(),
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn gemma3_it_template_folds_system_into_first_user_turn() {
        let template = ChatTemplate::new(Some(GEMMA3_IT_TEMPLATE), "<bos>", "<eos>").unwrap();
        assert_eq!(
            template.render(&conversation(), true).unwrap(),
            "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n\
             <start_of_turn>model\n4<end_of_turn>\n\
             <start_of_turn>user\nAnd 3+3?<end_of_turn>\n\
             <start_of_turn>model\n"
        );
    }

    #[test]
    fn gemma3_it_template_rejects_roles_that_do_not_alternate() {
        let template = ChatTemplate::new(Some(GEMMA3_IT_TEMPLATE), "<bos>", "<eos>").unwrap();
        let messages = [ChatMessage::new("user", "one"), ChatMessage::new("user", "two")];
        match template.render(&messages, true) {
            Err(TemplateError::Raised { message }) => {
                assert_eq!(
                    message,
                    "Conversation roles must alternate user/assistant/user/assistant/..."
                )
            }
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let messages = [ChatMessage::new("user", "a<b & 'c' é\n")];
        let cases = [
            (
                "{{ messages[0] | tojson }}",
                r#"{"role": "user", "content": "a<b & 'c' é\n"}"#,
            ),
            (
                "{{ {'b': 1, 'a': [1, 2.5, none, true]} | tojson }}",
                r#"{"b": 1, "a": [1, 2.5, null, true]}"#,
            ),
            (
                "{{ {'b': 1, 'a': [1, {}]} | tojson(indent=2) }}",
                "{\n  \"b\": 1,\n  \"a\": [\n    1,\n    {}\n  ]\n}",
            ),
            (
                "{{ [1, [2]] | tojson(indent=4) }}",
                "[\n    1,\n    [\n        2\n    ]\n]",
            ),
            ("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}", r#"{"a": 2, "b": 1}"#),
            ("{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}", r#"{"a":[1,2]}"#),
            ("{{ 'é😀' | tojson(ensure_ascii=true) }}", r#""\u00e9\ud83d\ude00""#),
            ("{{ {1: 'x'} | tojson }}", r#"{"1": "x"}"#),
            ("{{ ([1] + [2]) | tojson }}", "[1, 2]"),
            (
                "{{ 1.0 | tojson }} {{ 1e20 | tojson }} {{ 0.0001 | tojson }}",
                "1.0 1e+20 0.0001",
            ),
        ];
        for (source, expected) in cases {
            assert_eq!(render_source(source, &messages).unwrap(), expected, "{source}");
        }
        let err = render_source("{{ 1 | tojson(indent=2, bogus=1) }}", &messages).unwrap_err();
        assert!(matches!(err, TemplateError::Render { .. }), "{err:?}");
    }

    #[test]
    fn python_float_repr_matches_python() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.5, "1.5"),
            (100.0, "100.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (-2.5e300, "-2.5e+300"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (float, expected) in cases {
            assert_eq!(json::python_float_repr(float), expected, "{float:?}");
        }
    }

    #[test]
    fn python_methods_and_loop_controls_work() {
        let messages = [
            ChatMessage::new("user", "  Hello world  "),
            ChatMessage::new("assistant", "x"),
        ];
        let source = "{{ messages[0].content.strip() }}|{{ messages[0].content.strip().startswith('Hello') }}|\
                      {{ messages[0].content.split() | length }}|{{ messages[0].get('role') }}|\
                      {{ messages[0].get('tool_calls', 'none') }}|\
                      {% for key, value in messages[1].items() %}{{ key }}={{ value }};{% endfor %}|\
                      {% for message in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ message.role }}{% endfor %}";
        assert_eq!(
            render_source(source, &messages).unwrap(),
            "Hello world|True|2|user|none|role=assistant;content=x;|user"
        );
    }

    #[test]
    fn tools_is_none_and_whitespace_follows_transformers() {
        let source = "{% if tools %}tools{% else %}no tools{% endif %} {{ tools is none }} {{ tools is defined }}";
        assert_eq!(render_source(source, &[]).unwrap(), "no tools True True");
        // Booleans print as Python prints them.
        // trim_blocks eats the newline after a block tag, lstrip_blocks the indent before
        // one; the final newline is dropped (keep_trailing_newline off).
        let source =
            "{% for message in messages %}\n    {% if true %}\n{{ message.role }}\n    {% endif %}\n{% endfor %}\n";
        let messages = [ChatMessage::new("user", ""), ChatMessage::new("assistant", "")];
        assert_eq!(render_source(source, &messages).unwrap(), "user\nassistant\n");
        assert_eq!(
            render_source("{{ bos_token }}{{ eos_token }}\n", &[]).unwrap(),
            "<s></s>"
        );
    }

    #[test]
    fn strftime_formats_like_python() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let time = strftime::UtcDateTime::from_unix_seconds(1_709_211_909);
        let cases = [
            ("%d %b %Y", "29 Feb 2024"),
            ("%Y-%m-%d %H:%M:%S", "2024-02-29 13:05:09"),
            ("%A %B %-d, %I:%M %p", "Thursday February 29, 01:05 PM"),
            ("%a %j %y %e %u %w %Z %z %% %Q", "Thu 060 24 29 4 4 UTC +0000 % %Q"),
            ("%F %T %", "2024-02-29 13:05:09 %"),
        ];
        for (format, expected) in cases {
            assert_eq!(strftime::format(format, &time), expected, "{format}");
        }
        let epoch = strftime::UtcDateTime::from_unix_seconds(0);
        assert_eq!(strftime::format("%c", &epoch), "Thu Jan  1 00:00:00 1970");
        let new_year_eve = strftime::UtcDateTime::from_unix_seconds(1_735_689_599);
        assert_eq!(strftime::format("%F %T %j", &new_year_eve), "2024-12-31 23:59:59 366");
        let rendered = render_source("{{ strftime_now('%Y') }}", &[]).unwrap();
        assert!(rendered.len() == 4 && rendered.starts_with("20"), "{rendered}");
    }

    #[test]
    fn chat_template_is_shareable_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }
}
