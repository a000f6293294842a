//! Rules as the matcher runs them: each an ordered list of alternatives, each a sequence
//! of symbols. Repetitions and groups are already expanded into rules of their own.

use crate::GrammarError;

/// Most rules a grammar may have after expansion.
pub(crate) const MAX_RULES: usize = 8192;
/// Most symbols in all alternatives together.
pub(crate) const MAX_SYMBOLS: usize = 200_000;

/// A compiled grammar, checked so that the matcher always terminates.
#[derive(Clone, Debug, PartialEq)]
pub struct Grammar {
    pub(crate) rules: Vec<Rule>,
    pub(crate) root: u32,
}

/// One rule: its name (for errors) and its alternatives.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Rule {
    pub name: String,
    pub alts: Vec<Vec<Sym>>,
}

/// One symbol of a sequence.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Sym {
    /// One code point of a class.
    Chars(CharClass),
    /// Another rule.
    Rule(u32),
    /// Exactly this (special) token.
    Token(u32),
}

/// A set of code points: inclusive ranges, or everything outside them.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CharClass {
    pub negated: bool,
    pub ranges: Vec<(u32, u32)>,
}

impl CharClass {
    pub fn one(c: u32) -> CharClass {
        CharClass {
            negated: false,
            ranges: vec![(c, c)],
        }
    }

    pub fn matches(&self, c: u32) -> bool {
        self.ranges.iter().any(|&(low, high)| low <= c && c <= high) != self.negated
    }

    /// Whether some code point in `low..=high` (the completions of a character whose
    /// first bytes are known) is in the class.
    pub fn matches_any_in(&self, low: u32, high: u32) -> bool {
        if !self.negated {
            return self.ranges.iter().any(|&(a, b)| a <= high && low <= b);
        }
        // Negated: some point of low..=high is outside every range.
        let mut ranges = self.ranges.clone();
        ranges.sort_unstable();
        let mut next = low;
        for (a, b) in ranges {
            if a > next {
                break;
            }
            if b >= next {
                if b >= high {
                    return false;
                }
                next = b + 1;
            }
        }
        next <= high
    }
}

impl Grammar {
    /// Parses GBNF text (see the crate documentation) with `root` as the start rule.
    pub fn parse(text: &str) -> Result<Grammar, GrammarError> {
        crate::gbnf::parse(text)
    }

    /// Checks what the matcher relies on: every rule defined, nothing left-recursive.
    pub(crate) fn check(self) -> Result<Grammar, GrammarError> {
        let n = self.rules.len();
        if n > MAX_RULES {
            return Err(GrammarError::TooLarge(format!("{n} rules (at most {MAX_RULES})")));
        }
        let symbols: usize = self.rules.iter().flat_map(|r| &r.alts).map(Vec::len).sum();
        if symbols > MAX_SYMBOLS {
            return Err(GrammarError::TooLarge(format!(
                "{symbols} symbols (at most {MAX_SYMBOLS})"
            )));
        }
        for rule in &self.rules {
            for sym in rule.alts.iter().flatten() {
                if let Sym::Rule(r) = sym {
                    if *r as usize >= n {
                        return Err(GrammarError::Undefined(format!("#{r}")));
                    }
                }
            }
        }
        // Nullable rules, to a fixed point.
        let mut nullable = vec![false; n];
        loop {
            let mut changed = false;
            for (i, rule) in self.rules.iter().enumerate() {
                if nullable[i] {
                    continue;
                }
                let empty = rule
                    .alts
                    .iter()
                    .any(|alt| alt.iter().all(|s| matches!(s, Sym::Rule(r) if nullable[*r as usize])));
                if empty {
                    nullable[i] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        // Rules each rule can start with without consuming anything.
        let left: Vec<Vec<u32>> = self
            .rules
            .iter()
            .map(|rule| {
                let mut firsts = Vec::new();
                for alt in &rule.alts {
                    for sym in alt {
                        match sym {
                            Sym::Rule(r) => {
                                firsts.push(*r);
                                if !nullable[*r as usize] {
                                    break;
                                }
                            }
                            _ => break,
                        }
                    }
                }
                firsts
            })
            .collect();
        // A cycle in `left` is left recursion: iterative depth-first search with colours.
        let mut colour = vec![0u8; n];
        for start in 0..n {
            if colour[start] != 0 {
                continue;
            }
            let mut stack = vec![(start, 0usize)];
            colour[start] = 1;
            while let Some(&mut (rule, ref mut next)) = stack.last_mut() {
                if let Some(&child) = left[rule].get(*next) {
                    *next += 1;
                    let child = child as usize;
                    match colour[child] {
                        0 => {
                            colour[child] = 1;
                            stack.push((child, 0));
                        }
                        1 => return Err(GrammarError::LeftRecursive(self.rules[child].name.clone())),
                        _ => {}
                    }
                } else {
                    colour[rule] = 2;
                    stack.pop();
                }
            }
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negated_classes_match_partial_ranges() {
        let class = CharClass {
            negated: true,
            ranges: vec![(0x22, 0x22), (0x5c, 0x5c), (0, 0x1f)],
        };
        assert!(class.matches_any_in(0x80, 0xbf));
        assert!(!class.matches_any_in(0x22, 0x22));
        assert!(!class.matches_any_in(0, 0x1f));
        assert!(class.matches_any_in(0, 0x20));
        let digits = CharClass {
            negated: false,
            ranges: vec![(b'0' as u32, b'9' as u32)],
        };
        assert!(!digits.matches_any_in(0x80, 0x7ff));
        assert!(digits.matches_any_in(0x30, 0x30));
    }

    #[test]
    fn left_recursion_and_undefined_rules_are_refused() {
        for (text, expected) in [
            (
                "root ::= root \"a\" | \"b\"",
                GrammarError::LeftRecursive("root".into()),
            ),
            (
                "root ::= x\nx ::= y \"a\"\ny ::= \"\" | x",
                GrammarError::LeftRecursive("x".into()),
            ),
            ("root ::= (\"a\"?)*", GrammarError::LeftRecursive("root-3".into())),
            ("root ::= nothing", GrammarError::Undefined("nothing".into())),
            ("item ::= \"a\"", GrammarError::NoRoot),
        ] {
            assert_eq!(Grammar::parse(text).unwrap_err(), expected, "{text}");
        }
        // Recursion after a character is fine.
        Grammar::parse("root ::= \"(\" root \")\" | \"x\"").unwrap();
    }
}
