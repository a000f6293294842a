//! Grammar-constrained sampling: the text a sequence generates is kept inside a
//! context-free grammar, token by token.
//!
//! - [`Grammar::parse`] reads llama.cpp's GBNF (the subset below) into rules of code-point
//!   classes, rule references and special-token ids, refusing what the matcher could not
//!   run (undefined rules, left recursion, sizes past the limits).
//! - [`schema::to_gbnf`] compiles a JSON Schema (what OpenAI's `json_schema` response
//!   format and tool parameters carry) to GBNF; [`schema::json_object`] is any JSON object,
//!   [`schema::Builder`] writes grammars around several schemas (tool calls).
//! - [`Matcher`] follows one sequence through the grammar as llama.cpp's grammar sampler
//!   does (a set of pushdown stacks over code points, characters split across tokens
//!   included) and tells which tokens of a [`TokenTable`] may come next.
//!
//! GBNF as accepted here: `name ::= alternatives` one rule per line (a line ending in `|`
//! or inside parentheses continues); `"literal"` with `\n \r \t \\ \" \xHH \uHHHH`
//! escapes; `[a-z_]` and `[^"\\]` classes; `.` any character; `( … )` groups; `*`, `+`,
//! `?`, `{m}`, `{m,}`, `{m,n}`; `<[ID]>` one special token by id; `#` comments. The root
//! rule is `root`.
#![deny(unsafe_code)]

mod gbnf;
mod grammar;
mod matcher;
pub mod schema;
mod vocab;

pub use grammar::Grammar;
pub use matcher::Matcher;
pub use vocab::TokenTable;

/// Why a grammar or schema was refused, or a token could not be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The GBNF text does not parse.
    #[error("grammar syntax error at byte {at}: {message}")]
    Syntax {
        /// Byte offset in the grammar text.
        at: usize,
        /// What was expected.
        message: String,
    },
    /// A rule is used but never defined.
    #[error("grammar rule '{0}' is used but not defined")]
    Undefined(String),
    /// There is no `root` rule.
    #[error("grammar has no 'root' rule")]
    NoRoot,
    /// A rule can reach itself without consuming a character, which the matcher cannot run.
    #[error("grammar rule '{0}' is left-recursive")]
    LeftRecursive(String),
    /// The grammar (or its expansion) is larger than a sequence may carry.
    #[error("grammar too large: {0}")]
    TooLarge(String),
    /// The JSON Schema uses something that cannot be enforced.
    #[error("unsupported JSON schema at {path}: {message}")]
    Schema {
        /// Where in the schema (JSON pointer).
        path: String,
        /// What is not supported.
        message: String,
    },
    /// Following the grammar branched into more alternatives than the matcher keeps.
    #[error("the grammar is too ambiguous: more than {0} parses at once")]
    Ambiguous(usize),
    /// A token that the grammar does not allow here.
    #[error("token {0} is not allowed by the grammar here")]
    Rejected(u32),
}
