//! Following one sequence through a grammar, llama.cpp's way (`llama-grammar.cpp`): the
//! state is a set of stacks, one per way the text so far can be parsed; each stack's top
//! is the terminal that must come next and the entries below it are where to go on once
//! the rule being matched ends. An empty stack means the grammar is complete.
//!
//! Which tokens may come next is found for all tokens at once, character by character:
//! the tokens whose first character fits a stack's top all move to the same next stacks
//! (a terminal leaves the same stacks whichever of its characters matched), so each level
//! costs one stack expansion plus one class test per token still alive.

use std::sync::Arc;

use crate::grammar::{Grammar, Sym};
use crate::vocab::{decode, Kind, Partial, TokenTable};
use crate::GrammarError;

/// Most parses kept at once; past this the grammar is refused as too ambiguous.
const MAX_STACKS: usize = 256;

/// A position in a rule: alternative `alt` of rule `rule`, before symbol `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pos {
    rule: u32,
    alt: u32,
    index: u32,
}

type Stack = Vec<Pos>;

/// One sequence's place in its grammar.
#[derive(Clone, Debug)]
pub struct Matcher {
    grammar: Arc<Grammar>,
    stacks: Vec<Stack>,
    partial: Partial,
}

/// A token still being matched: at code point `at` of the table, up to `end`.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    token: u32,
    at: u32,
    end: u32,
    trailing: Partial,
}

impl Matcher {
    /// At the start of `grammar`'s root rule.
    pub fn new(grammar: Arc<Grammar>) -> Result<Matcher, GrammarError> {
        let root = grammar.root;
        let mut stacks = Vec::new();
        for alt in 0..grammar.rules[root as usize].alts.len() as u32 {
            expand(
                &grammar,
                vec![Pos {
                    rule: root,
                    alt,
                    index: 0,
                }],
                &mut stacks,
            )?;
        }
        Ok(Matcher {
            grammar,
            stacks,
            partial: Partial::default(),
        })
    }

    /// Whether the text so far is a whole sentence of the grammar (generation may end).
    pub fn is_complete(&self) -> bool {
        !self.partial.pending() && self.stacks.iter().any(Vec::is_empty)
    }

    /// Whether no continuation is possible any more.
    pub fn is_dead(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Moves past `token`; refuses (and stays put) when the grammar does not allow it.
    pub fn accept(&mut self, token: u32, table: &TokenTable) -> Result<(), GrammarError> {
        let next = self.after(token, table)?.ok_or(GrammarError::Rejected(token))?;
        (self.stacks, self.partial) = next;
        Ok(())
    }

    /// Whether `token` may come next.
    pub fn allows(&self, token: u32, table: &TokenTable) -> bool {
        matches!(self.after(token, table), Ok(Some(_)))
    }

    /// The state after `token`, `None` if it is not allowed.
    fn after(&self, token: u32, table: &TokenTable) -> Result<Option<(Vec<Stack>, Partial)>, GrammarError> {
        let Some(kind) = table.kinds.get(token as usize) else {
            return Ok(None);
        };
        match kind {
            Kind::EndOfGeneration => Ok(self.is_complete().then(|| (vec![Vec::new()], Partial::default()))),
            Kind::Special => {
                if self.partial.pending() {
                    return Ok(None);
                }
                let mut next = Vec::new();
                for stack in &self.stacks {
                    if let Some(top) = stack.last() {
                        if sym(&self.grammar, *top) == Some(&Sym::Token(token)) {
                            expand(&self.grammar, advanced(stack), &mut next)?;
                        }
                    }
                }
                Ok((!next.is_empty()).then_some((next, Partial::default())))
            }
            Kind::Text { .. } | Kind::Fragment => {
                let mut code_points = Vec::new();
                let Some(partial) = decode(&table.bytes[token as usize], self.partial, &mut code_points) else {
                    return Ok(None);
                };
                let mut stacks = self.stacks.clone();
                for c in code_points {
                    stacks = self.accept_char(&stacks, c)?;
                    if stacks.is_empty() {
                        return Ok(None);
                    }
                }
                if partial.pending() {
                    let Some((low, high)) = partial.range() else {
                        return Ok(None);
                    };
                    stacks.retain(|stack| {
                        stack.last().is_some_and(|top| {
                            matches!(sym(&self.grammar, *top), Some(Sym::Chars(class)) if class.matches_any_in(low, high))
                        })
                    });
                    if stacks.is_empty() {
                        return Ok(None);
                    }
                }
                Ok(Some((stacks, partial)))
            }
        }
    }

    fn accept_char(&self, stacks: &[Stack], c: u32) -> Result<Vec<Stack>, GrammarError> {
        let mut next = Vec::new();
        for stack in stacks {
            let Some(top) = stack.last() else { continue };
            if matches!(sym(&self.grammar, *top), Some(Sym::Chars(class)) if class.matches(c)) {
                expand(&self.grammar, advanced(stack), &mut next)?;
            }
        }
        Ok(next)
    }

    /// Sets `allowed[token]` for every token that may come next (and clears the rest).
    pub fn fill_allowed(&self, table: &TokenTable, allowed: &mut Vec<bool>) -> Result<(), GrammarError> {
        allowed.clear();
        allowed.resize(table.len(), false);
        let complete = self.is_complete();
        let mut candidates = Vec::new();
        let mut code_points: Vec<u32> = Vec::new();
        let decoded_here = self.partial.pending();
        for (token, kind) in table.kinds.iter().enumerate() {
            let token = token as u32;
            match *kind {
                Kind::EndOfGeneration => allowed[token as usize] = complete,
                Kind::Special => allowed[token as usize] = self.allows(token, table),
                Kind::Text { start, end, trailing } if !decoded_here => candidates.push(Candidate {
                    token,
                    at: start,
                    end,
                    trailing,
                }),
                Kind::Text { .. } | Kind::Fragment if decoded_here => {
                    // Mid-character: decode from the pending bytes (rare, a few tokens).
                    let start = code_points.len() as u32;
                    let Some(trailing) = decode(&table.bytes[token as usize], self.partial, &mut code_points) else {
                        code_points.truncate(start as usize);
                        continue;
                    };
                    candidates.push(Candidate {
                        token,
                        at: start,
                        end: code_points.len() as u32,
                        trailing,
                    });
                }
                Kind::Text { .. } | Kind::Fragment => {}
            }
        }
        let code_points = if decoded_here { &code_points } else { &table.code_points };
        let search = Search {
            grammar: &self.grammar,
            code_points,
        };
        let rejected = search.reject(&self.stacks, candidates.clone())?;
        for candidate in &candidates {
            allowed[candidate.token as usize] = true;
        }
        for candidate in rejected {
            allowed[candidate.token as usize] = false;
        }
        Ok(())
    }
}

struct Search<'a> {
    grammar: &'a Grammar,
    code_points: &'a [u32],
}

impl Search<'_> {
    /// The candidates that no stack accepts (returned as given).
    fn reject(&self, stacks: &[Stack], candidates: Vec<Candidate>) -> Result<Vec<Candidate>, GrammarError> {
        let mut rejected = candidates;
        for stack in stacks {
            if rejected.is_empty() {
                break;
            }
            rejected = self.reject_for_stack(stack, &rejected)?;
        }
        Ok(rejected)
    }

    fn reject_for_stack(&self, stack: &Stack, candidates: &[Candidate]) -> Result<Vec<Candidate>, GrammarError> {
        let mut rejected = Vec::new();
        let Some(&top) = stack.last() else {
            // Complete: only a token with nothing left fits.
            rejected.extend(candidates.iter().filter(|c| c.at < c.end || c.trailing.pending()));
            return Ok(rejected);
        };
        let class = match sym(self.grammar, top) {
            Some(Sym::Chars(class)) => Some(class),
            _ => None,
        };
        let mut next = Vec::new();
        for candidate in candidates {
            if candidate.at == candidate.end {
                let fits = match (class, candidate.trailing.pending()) {
                    (_, false) => true,
                    (Some(class), true) => candidate
                        .trailing
                        .range()
                        .is_some_and(|(low, high)| class.matches_any_in(low, high)),
                    (None, true) => false,
                };
                if !fits {
                    rejected.push(*candidate);
                }
                continue;
            }
            let c = self.code_points[candidate.at as usize];
            if class.is_some_and(|class| class.matches(c)) {
                next.push(Candidate {
                    at: candidate.at + 1,
                    ..*candidate
                });
            } else {
                rejected.push(*candidate);
            }
        }
        if next.is_empty() {
            return Ok(rejected);
        }
        let mut stacks = Vec::new();
        expand(self.grammar, advanced(stack), &mut stacks)?;
        let deeper = self.reject(&stacks, next)?;
        rejected.extend(deeper.into_iter().map(|c| Candidate { at: c.at - 1, ..c }));
        Ok(rejected)
    }
}

fn sym(grammar: &Grammar, pos: Pos) -> Option<&Sym> {
    grammar.rules[pos.rule as usize].alts[pos.alt as usize].get(pos.index as usize)
}

/// `stack` with its top terminal consumed (not yet expanded).
fn advanced(stack: &Stack) -> Stack {
    let mut next = stack.clone();
    if let Some(top) = next.last_mut() {
        top.index += 1;
    }
    next
}

/// Resolves `stack` until its top is a terminal (or it is empty), adding every result
/// to `out` once. Terminates because the grammar has no left recursion; iterative, so
/// that a long chain of rules cannot exhaust the thread's stack.
fn expand(grammar: &Grammar, stack: Stack, out: &mut Vec<Stack>) -> Result<(), GrammarError> {
    let mut work = vec![stack];
    'stacks: while let Some(mut stack) = work.pop() {
        while let Some(&top) = stack.last() {
            match sym(grammar, top) {
                None => {
                    stack.pop();
                }
                Some(Sym::Rule(rule)) => {
                    let rule = *rule;
                    stack.pop();
                    let after = Pos {
                        index: top.index + 1,
                        ..top
                    };
                    if sym(grammar, after).is_some() {
                        stack.push(after);
                    }
                    // Reversed, so that alternatives come out in order.
                    for alt in (0..grammar.rules[rule as usize].alts.len() as u32).rev() {
                        let mut branch = stack.clone();
                        branch.push(Pos { rule, alt, index: 0 });
                        work.push(branch);
                    }
                    continue 'stacks;
                }
                Some(_) => break,
            }
        }
        if !out.contains(&stack) {
            if out.len() >= MAX_STACKS {
                return Err(GrammarError::Ambiguous(MAX_STACKS));
            }
            out.push(stack);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
