//! The GBNF reader: text in, checked [`Grammar`] out. Repetitions and groups become rules
//! of their own, named after the rule they appear in (`value-3`).

use std::collections::HashMap;

use crate::grammar::{CharClass, Grammar, Rule, Sym, MAX_RULES};
use crate::GrammarError;

/// Largest bound a `{m,n}` repetition may give (each copy is expanded).
const MAX_REPEAT: u32 = 1000;
/// Deepest nesting of parentheses (the reader recurses on them).
const MAX_DEPTH: usize = 64;
/// Longest grammar text.
pub const MAX_TEXT: usize = 256 << 10;

pub(crate) fn parse(text: &str) -> Result<Grammar, GrammarError> {
    if text.len() > MAX_TEXT {
        return Err(GrammarError::TooLarge(format!(
            "{} bytes of grammar text (at most {MAX_TEXT})",
            text.len()
        )));
    }
    let mut parser = Parser {
        text: text.as_bytes(),
        pos: 0,
        rules: Vec::new(),
        names: HashMap::new(),
        defined: Vec::new(),
        depth: 0,
    };
    parser.grammar()?;
    for (i, defined) in parser.defined.iter().enumerate() {
        if !defined {
            return Err(GrammarError::Undefined(parser.rules[i].name.clone()));
        }
    }
    let root = *parser.names.get("root").ok_or(GrammarError::NoRoot)?;
    Grammar {
        rules: parser.rules,
        root,
    }
    .check()
}

struct Parser<'a> {
    text: &'a [u8],
    pos: usize,
    rules: Vec<Rule>,
    names: HashMap<String, u32>,
    defined: Vec<bool>,
    depth: usize,
}

type Alts = Vec<Vec<Sym>>;

impl Parser<'_> {
    fn error<T>(&self, message: impl Into<String>) -> Result<T, GrammarError> {
        Err(GrammarError::Syntax {
            at: self.pos,
            message: message.into(),
        })
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    /// Skips spaces and comments; newlines too when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' => self.pos += 1,
                b'\r' | b'\n' if newlines => self.pos += 1,
                b'#' => {
                    while self.peek().is_some_and(|c| c != b'\n') {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        {
            self.pos += 1;
        }
        (self.pos > start).then(|| String::from_utf8_lossy(&self.text[start..self.pos]).into_owned())
    }

    fn rule_id(&mut self, name: &str) -> Result<u32, GrammarError> {
        if let Some(&id) = self.names.get(name) {
            return Ok(id);
        }
        self.new_rule(name.to_string())
    }

    fn new_rule(&mut self, name: String) -> Result<u32, GrammarError> {
        if self.rules.len() >= MAX_RULES {
            return Err(GrammarError::TooLarge(format!("more than {MAX_RULES} rules")));
        }
        let id = self.rules.len() as u32;
        self.names.insert(name.clone(), id);
        self.rules.push(Rule { name, alts: Vec::new() });
        self.defined.push(false);
        Ok(id)
    }

    /// A rule generated for a group or a repetition inside `parent`.
    fn helper(&mut self, parent: &str, alts: Alts) -> Result<u32, GrammarError> {
        let mut n = 1;
        while self.names.contains_key(&format!("{parent}-{n}")) {
            n += 1;
        }
        let id = self.new_rule(format!("{parent}-{n}"))?;
        self.rules[id as usize].alts = alts;
        self.defined[id as usize] = true;
        Ok(id)
    }

    fn grammar(&mut self) -> Result<(), GrammarError> {
        loop {
            self.space(true);
            if self.peek().is_none() {
                return Ok(());
            }
            let Some(name) = self.name() else {
                return self.error("expected a rule name");
            };
            self.space(false);
            if !self.text[self.pos..].starts_with(b"::=") {
                return self.error(format!("expected '::=' after '{name}'"));
            }
            self.pos += 3;
            self.space(true);
            let id = self.rule_id(&name)?;
            if self.defined[id as usize] {
                return self.error(format!("rule '{name}' is defined twice"));
            }
            let alts = self.alternatives(&name, false)?;
            self.rules[id as usize].alts = alts;
            self.defined[id as usize] = true;
            // A rule ends at a line break; an empty last alternative (`a ::= b |`) has
            // already skipped it.
            let line_ended = self.text[..self.pos]
                .iter()
                .rev()
                .find(|&&c| c != b' ' && c != b'\t')
                .is_some_and(|&c| c == b'\n');
            match self.peek() {
                None | Some(b'\n' | b'\r') => {}
                Some(_) if line_ended => {}
                Some(c) => return self.error(format!("unexpected '{}'", c as char)),
            }
        }
    }

    fn alternatives(&mut self, rule: &str, nested: bool) -> Result<Alts, GrammarError> {
        let mut alts = vec![self.sequence(rule, nested)?];
        while self.peek() == Some(b'|') {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(rule, nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, rule: &str, nested: bool) -> Result<Vec<Sym>, GrammarError> {
        let mut seq: Vec<Sym> = Vec::new();
        loop {
            // Where the last item starts, for a postfix operator to apply to.
            let item_start = seq.len();
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    while self.peek() != Some(b'"') {
                        if self.peek().is_none() {
                            return self.error("unterminated literal");
                        }
                        let c = self.char()?;
                        seq.push(Sym::Chars(CharClass::one(c)));
                    }
                    self.pos += 1;
                    if seq.len() == item_start {
                        // "" is the empty sequence; a postfix on it means nothing.
                        self.space(nested);
                        continue;
                    }
                    // A literal of several characters is one item for postfixes.
                    if seq.len() - item_start > 1 && self.postfix_follows() {
                        let group = seq.split_off(item_start);
                        let id = self.helper(rule, vec![group])?;
                        seq.push(Sym::Rule(id));
                    }
                }
                Some(b'[') => {
                    self.pos += 1;
                    let negated = self.peek() == Some(b'^');
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    while self.peek() != Some(b']') {
                        if self.peek().is_none() {
                            return self.error("unterminated character class");
                        }
                        let low = self.char()?;
                        let high = if self.peek() == Some(b'-') && self.text.get(self.pos + 1) != Some(&b']') {
                            self.pos += 1;
                            self.char()?
                        } else {
                            low
                        };
                        if high < low {
                            return self.error("character range out of order");
                        }
                        ranges.push((low, high));
                    }
                    self.pos += 1;
                    seq.push(Sym::Chars(CharClass { negated, ranges }));
                }
                Some(b'.') => {
                    self.pos += 1;
                    seq.push(Sym::Chars(CharClass {
                        negated: true,
                        ranges: Vec::new(),
                    }));
                }
                Some(b'(') => {
                    if self.depth >= MAX_DEPTH {
                        return self.error(format!("parentheses nested deeper than {MAX_DEPTH}"));
                    }
                    self.pos += 1;
                    self.space(true);
                    self.depth += 1;
                    let alts = self.alternatives(rule, true);
                    self.depth -= 1;
                    let alts = alts?;
                    if self.peek() != Some(b')') {
                        return self.error("expected ')'");
                    }
                    self.pos += 1;
                    let id = self.helper(rule, alts)?;
                    seq.push(Sym::Rule(id));
                }
                Some(b'<') if self.text.get(self.pos + 1) == Some(&b'[') => {
                    self.pos += 2;
                    let start = self.pos;
                    while self.peek().is_some_and(|c| c.is_ascii_digit()) {
                        self.pos += 1;
                    }
                    let id = std::str::from_utf8(&self.text[start..self.pos])
                        .ok()
                        .and_then(|s| s.parse::<u32>().ok());
                    let Some(id) = id else {
                        return self.error("expected a token id in <[...]>");
                    };
                    if !self.text[self.pos..].starts_with(b"]>") {
                        return self.error("expected ']>'");
                    }
                    self.pos += 2;
                    seq.push(Sym::Token(id));
                }
                Some(c) if c.is_ascii_alphanumeric() || c == b'-' || c == b'_' => {
                    let save = self.pos;
                    let name = self.name().unwrap_or_default();
                    // `name ::=` starts the next rule: this sequence has ended.
                    let after = self.pos;
                    self.space(false);
                    if self.text[self.pos..].starts_with(b"::=") {
                        self.pos = save;
                        return Ok(seq);
                    }
                    self.pos = after;
                    let id = self.rule_id(&name)?;
                    seq.push(Sym::Rule(id));
                }
                _ => return Ok(seq),
            }
            self.postfix(rule, &mut seq)?;
            self.space(nested);
        }
    }

    fn postfix_follows(&self) -> bool {
        matches!(self.peek(), Some(b'*' | b'+' | b'?' | b'{'))
    }

    /// Applies `*`, `+`, `?` or `{m,n}` to the last symbol of `seq`.
    fn postfix(&mut self, rule: &str, seq: &mut Vec<Sym>) -> Result<(), GrammarError> {
        let (min, max) = match self.peek() {
            Some(b'*') => (0, None),
            Some(b'+') => (1, None),
            Some(b'?') => (0, Some(1)),
            Some(b'{') => {
                self.pos += 1;
                self.space(false);
                let min = self.number()?;
                self.space(false);
                let max = if self.peek() == Some(b',') {
                    self.pos += 1;
                    self.space(false);
                    if self.peek() == Some(b'}') {
                        None
                    } else {
                        Some(self.number()?)
                    }
                } else {
                    Some(min)
                };
                self.space(false);
                if self.peek() != Some(b'}') {
                    return self.error("expected '}'");
                }
                if max.is_some_and(|max| max < min) {
                    return self.error("repetition bounds out of order");
                }
                (min, max)
            }
            _ => return Ok(()),
        };
        self.pos += 1;
        let Some(item) = seq.pop() else {
            return self.error("a repetition needs something to repeat");
        };
        for _ in 0..min {
            seq.push(item.clone());
        }
        match max {
            None => {
                // star ::= item star | ε
                let id = self.helper(rule, Vec::new())?;
                self.rules[id as usize].alts = vec![vec![item, Sym::Rule(id)], Vec::new()];
                seq.push(Sym::Rule(id));
            }
            Some(max) if max > min => {
                // (item (item (item)?)?)? : one parse for each count.
                let mut tail: Option<u32> = None;
                for _ in min..max {
                    let mut alt = vec![item.clone()];
                    alt.extend(tail.map(Sym::Rule));
                    tail = Some(self.helper(rule, vec![alt, Vec::new()])?);
                }
                seq.extend(tail.map(Sym::Rule));
            }
            Some(_) => {}
        }
        Ok(())
    }

    fn number(&mut self) -> Result<u32, GrammarError> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        match std::str::from_utf8(&self.text[start..self.pos])
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
        {
            Some(n) if n <= MAX_REPEAT => Ok(n),
            Some(n) => self.error(format!("repetition count {n} is above {MAX_REPEAT}")),
            None => self.error("expected a number"),
        }
    }

    /// One character of a literal or class, escapes decoded.
    fn char(&mut self) -> Result<u32, GrammarError> {
        let rest = std::str::from_utf8(&self.text[self.pos..]).map_err(|_| GrammarError::Syntax {
            at: self.pos,
            message: "invalid UTF-8".into(),
        })?;
        let Some(c) = rest.chars().next() else {
            return self.error("unexpected end");
        };
        self.pos += c.len_utf8();
        if c != '\\' {
            return Ok(c as u32);
        }
        let Some(escaped) = self.peek() else {
            return self.error("unterminated escape");
        };
        self.pos += 1;
        let hex = |parser: &mut Self, digits: usize| -> Result<u32, GrammarError> {
            let end = parser.pos + digits;
            let value = parser
                .text
                .get(parser.pos..end)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u32::from_str_radix(h, 16).ok());
            match value {
                Some(v) => {
                    parser.pos = end;
                    Ok(v)
                }
                None => parser.error(format!("expected {digits} hex digits")),
            }
        };
        Ok(match escaped {
            b'n' => '\n' as u32,
            b'r' => '\r' as u32,
            b't' => '\t' as u32,
            b'x' => hex(self, 2)?,
            b'u' => hex(self, 4)?,
            b'U' => hex(self, 8)?,
            b'\\' | b'"' | b'[' | b']' | b'-' | b'^' => escaped as u32,
            other => return self.error(format!("unknown escape '\\{}'", other as char)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syntax_errors_say_where() {
        for (text, at, needle) in [
            ("root ::= \"abc", 13, "unterminated literal"),
            ("root ::= [a-", 12, "unexpected end"),
            ("root = \"a\"", 5, "'::='"),
            ("root ::= \"a\"{5,2}", 16, "out of order"),
            ("root ::= \"a\"{2000}", 17, "above 1000"),
            ("root ::= (\"a\"", 13, "expected ')'"),
            ("root ::= <[x]>", 11, "token id"),
            ("root ::= \"\\q\"", 12, "unknown escape"),
            ("root ::= \"a\"\nroot ::= \"b\"", 22, "defined twice"),
            (&format!("root ::= {}", "(".repeat(100)), 73, "nested deeper than 64"),
        ] {
            match parse(text) {
                Err(GrammarError::Syntax { at: got, message }) => {
                    assert!(message.contains(needle), "{text:?}: {message}");
                    assert_eq!(got, at, "{text:?}: {message}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn rules_span_lines_after_a_bar_and_inside_parentheses() {
        let grammar = parse("root ::= \"a\" |\n  \"b\"\nother ::= (\n \"c\"\n | \"d\" )\n# done\n").unwrap();
        assert_eq!(grammar.rules.len(), 3);
        assert_eq!(grammar.rules[0].alts.len(), 2);
        assert_eq!(grammar.rules[2].name, "other-1");
    }
}
