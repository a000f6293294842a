use super::*;

/// One token per printable ASCII character, a few longer ones, the three bytes of '€'
/// separately and whole, a control token (id 200) and an end token (id 201).
fn table() -> TokenTable {
    let mut tokens: Vec<(Vec<u8>, bool)> = (0u8..128).map(|b| (vec![b], false)).collect();
    for text in ["true", "false", "\": ", "{\"", "\"}", "ab", "null", " {", "€", "é\""] {
        tokens.push((text.as_bytes().to_vec(), false));
    }
    for byte in "€".as_bytes() {
        tokens.push((vec![*byte], false));
    }
    tokens.resize(200, (b"zz".to_vec(), false));
    tokens.push((Vec::new(), false));
    tokens.push((Vec::new(), true));
    TokenTable::new(tokens)
}

fn matcher(gbnf: &str) -> Matcher {
    Matcher::new(Arc::new(Grammar::parse(gbnf).unwrap())).unwrap()
}

fn token(table: &TokenTable, text: &[u8]) -> u32 {
    (0..table.len() as u32).find(|&t| table.bytes(t) == Some(text)).unwrap()
}

/// The mask computed for all tokens at once agrees with trying each token alone.
fn assert_mask_consistent(m: &Matcher, table: &TokenTable) -> Vec<bool> {
    let mut allowed = Vec::new();
    m.fill_allowed(table, &mut allowed).unwrap();
    for t in 0..table.len() as u32 {
        assert_eq!(
            allowed[t as usize],
            m.allows(t, table),
            "token {t} {:?}",
            table.bytes(t)
        );
    }
    allowed
}

#[test]
fn the_mask_agrees_with_single_tokens_at_every_step() {
    let table = table();
    let mut m = matcher(
        r#"root ::= "{" ws "\"a\": " value "}" | "x" [0-9]+ ("." [0-9]*)?
value ::= "true" | "false" | "null" | "\"" [^"\\]* "\""
ws ::= " "?"#,
    );
    for piece in ["{\"", "a", "\": ", "\"", "€", "é\"", "}"] {
        let allowed = assert_mask_consistent(&m, &table);
        let t = token(&table, piece.as_bytes());
        assert!(allowed[t as usize], "{piece} should be allowed");
        m.accept(t, &table).unwrap();
    }
    assert!(m.is_complete());
    let allowed = assert_mask_consistent(&m, &table);
    assert_eq!(allowed.iter().filter(|&&a| a).count(), 1, "only the end token");
    assert!(allowed[201]);
}

#[test]
fn a_character_split_across_tokens_is_matched_whole() {
    let table = table();
    let euro = "€".as_bytes();
    let mut m = matcher(r#"root ::= "[" [€-€] "]""#);
    m.accept(token(&table, b"["), &table).unwrap();
    let first = token(&table, &euro[..1]);
    assert!(assert_mask_consistent(&m, &table)[first as usize]);
    m.accept(first, &table).unwrap();
    // Mid-character only the continuation fits.
    let allowed = assert_mask_consistent(&m, &table);
    let second = token(&table, &euro[1..2]);
    assert_eq!(allowed.iter().filter(|&&a| a).count(), 1);
    assert!(allowed[second as usize]);
    m.accept(second, &table).unwrap();
    m.accept(token(&table, &euro[2..]), &table).unwrap();
    m.accept(token(&table, b"]"), &table).unwrap();
    assert!(m.is_complete());
    // A character outside the class is refused even by its first byte.
    let mut m = matcher(r#"root ::= [a-z]"#);
    assert!(!m.allows(first, &table));
    assert_eq!(m.accept(first, &table), Err(GrammarError::Rejected(first)));
}

/// Qwen2's byte tokens E0, 80 and A0 spell an overlong space: sampled after a JSON
/// answer's closing brace, where only blanks may follow, they once passed for blanks
/// and ran the text past the grammar. Nothing that is not UTF-8 passes for a character:
/// overlong forms, surrogates, code points past U+10FFFF.
#[test]
fn bytes_that_are_not_utf8_never_pass_for_a_character() {
    let mut tokens: Vec<(Vec<u8>, bool)> = (0u8..=255).map(|b| (vec![b], false)).collect();
    tokens.push((Vec::new(), true));
    let table = TokenTable::new(tokens);
    let end = 256;
    let mut m = matcher(r#"root ::= "}" [ \t]{0,20}"#);
    m.accept(u32::from(b'}'), &table).unwrap();
    m.accept(u32::from(b' '), &table).unwrap();
    let allowed = assert_mask_consistent(&m, &table);
    let passing: Vec<usize> = (0..allowed.len()).filter(|&t| allowed[t]).collect();
    assert_eq!(passing, [9, 32, end as usize], "a blank or the end, nothing else");
    // Any character at all: the first bytes of each form are checked as they come.
    let m = matcher(r#"root ::= [^"]"#);
    let bad: [&[u8]; 8] = [
        &[0xe0, 0x80],
        &[0xe0, 0x9f],
        &[0xc0],
        &[0xc1],
        &[0xed, 0xa0],
        &[0xf0, 0x80],
        &[0xf4, 0x90],
        &[0xf5],
    ];
    for bad in bad {
        let mut probe = m.clone();
        let accepted = bad.iter().all(|&b| probe.accept(u32::from(b), &table).is_ok());
        assert!(!accepted, "{bad:02x?} begins no character");
    }
    for good in ["é", "\u{800}", "€", "\u{d7ff}", "\u{e000}", "\u{10000}", "\u{10ffff}"] {
        let mut probe = m.clone();
        for &b in good.as_bytes() {
            assert!(assert_mask_consistent(&probe, &table)[usize::from(b)], "{good:?}");
            probe.accept(u32::from(b), &table).unwrap();
        }
        assert!(probe.is_complete(), "{good:?}");
    }
}

#[test]
fn special_tokens_only_where_the_grammar_names_them() {
    let table = table();
    let mut m = matcher("root ::= <[200]> \"a\"");
    let allowed = assert_mask_consistent(&m, &table);
    assert_eq!(allowed.iter().filter(|&&a| a).count(), 1);
    m.accept(200, &table).unwrap();
    assert!(!m.allows(200, &table));
    m.accept(token(&table, b"a"), &table).unwrap();
    assert!(m.allows(201, &table));
    let m = matcher("root ::= \"a\"*");
    assert!(!m.allows(200, &table), "a control token is never text");
    assert!(m.allows(201, &table), "an empty sentence may end at once");
}

#[test]
fn repetition_bounds_hold() {
    let table = table();
    let mut m = matcher("root ::= [0-9]{2,3}");
    let digit = token(&table, b"7");
    assert!(!m.allows(201, &table));
    m.accept(digit, &table).unwrap();
    assert!(!m.is_complete());
    m.accept(digit, &table).unwrap();
    assert!(m.is_complete());
    m.accept(digit, &table).unwrap();
    assert!(!m.allows(digit, &table));
    assert!(m.allows(201, &table));
}

#[test]
fn ambiguity_is_bounded() {
    // Every prefix of a's parses 2^n ways into x's and y's.
    let grammar = Grammar::parse("root ::= (x | y)*\nx ::= \"a\"\ny ::= \"a\"").unwrap();
    let table = table();
    let mut m = Matcher::new(Arc::new(grammar)).unwrap();
    for _ in 0..20 {
        m.accept(token(&table, b"a"), &table).unwrap();
    }
    assert!(m.stacks.len() <= 4, "duplicate parses are merged: {}", m.stacks.len());
}

#[test]
fn hostile_grammars_fail_cleanly() {
    // A chain of 5,000 rules down the left edge: expanded without recursion.
    let mut text = String::from("root ::= r0\n");
    for i in 0..5000 {
        text.push_str(&format!("r{i} ::= r{} \"a\"\n", i + 1));
    }
    text.push_str("r5000 ::= \"b\"");
    let table = table();
    let m = matcher(&text);
    assert!(m.allows(token(&table, b"b"), &table));
    // 300 parses of the same text at once: refused, not followed.
    let alternatives = vec!["\"a\""; 300].join(" | ");
    let grammar = Grammar::parse(&format!("root ::= ({alternatives}) \"b\"")).unwrap();
    assert_eq!(
        Matcher::new(Arc::new(grammar)).unwrap_err(),
        GrammarError::Ambiguous(256)
    );
}
