// Drives loom-serve with the official `openai` npm client (pinned in scripts/install-deps) and
// prints one JSON object of what came back; serve_e2e_test.py checks it against loom-train.
// usage: node serve_openai_client.js OPENAI_MODULE BASE_URL TOKEN LMEVAL_PROMPT_JSON
const [moduleDir, baseURL, token, lmevalPrompt] = process.argv.slice(2);
const { OpenAI, APIError } = require(moduleDir);

async function main() {
  const client = new OpenAI({ baseURL, apiKey: token, maxRetries: 0, timeout: 120000 });
  const out = {};
  const models = await client.models.list();
  out.models = models.data.map((m) => m.id);
  const model = out.models[0];

  // lm-evaluation-harness local-completions, loglikelihood: exactly its payload.
  const ll = await client.completions.create({
    model, prompt: [JSON.parse(lmevalPrompt)], temperature: 0, max_tokens: 1, logprobs: 1,
    seed: 1234, echo: true,
  });
  out.loglikelihood = ll.choices[0];
  out.loglikelihood_usage = ll.usage;

  // Generation, whole and streamed, greedy: the stream must spell the same text.
  const prompt = 'The relation ';
  const whole = await client.completions.create({ model, prompt, max_tokens: 24, temperature: 0 });
  out.completion = whole.choices[0];
  let streamed = '';
  let finish = null;
  const stream = await client.completions.create({
    model, prompt, max_tokens: 24, temperature: 0, stream: true,
  });
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      streamed += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  out.completion_streamed = { text: streamed, finish_reason: finish };

  // Chat with the SFT template, whole and streamed.
  const messages = [{ role: 'user', content: 'a is the parent of b. Who is the parent of b?' }];
  const chat = await client.chat.completions.create({ model, messages, max_tokens: 48, temperature: 0 });
  out.chat = chat.choices[0];
  let chatStreamed = '';
  let role = null;
  let chatFinish = null;
  const chatStream = await client.chat.completions.create({
    model, messages, max_tokens: 48, temperature: 0, stream: true,
  });
  for await (const chunk of chatStream) {
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      if (c.delta.content) chatStreamed += c.delta.content;
      if (c.finish_reason) chatFinish = c.finish_reason;
    }
  }
  out.chat_streamed = { role, content: chatStreamed, finish_reason: chatFinish };

  // 32 simultaneous greedy requests, each compared with the same request served alone.
  const prompts = Array.from({ length: 32 }, (_, i) => `${String.fromCharCode(97 + (i % 26))} is ${i} `);
  const alone = [];
  for (const p of prompts) {
    const r = await client.completions.create({ model, prompt: p, max_tokens: 16, temperature: 0 });
    alone.push(r.choices[0].text);
  }
  const together = await Promise.all(prompts.map((p) =>
    client.completions.create({ model, prompt: p, max_tokens: 16, temperature: 0 })));
  out.concurrent = { alone, together: together.map((r) => r.choices[0].text) };

  // An invalid request surfaces as the client's APIError with the field named.
  try {
    await client.completions.create({ model, prompt, max_tokens: -1 });
    out.error = null;
  } catch (e) {
    out.error = e instanceof APIError ? { status: e.status, param: e.param, message: e.message } : String(e);
  }
  console.log(JSON.stringify(out));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
