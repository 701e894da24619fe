// Shared by the Node.js suites: flags, the npm packages scripts/install-deps put in .tools/, and
// a seeded generator so generated inputs are the same on every run.
'use strict';
const path = require('node:path');

// --name value pairs of the command line, and `source` (--source-dir, default .) whose
// .tools/node_modules the caller's require() then searches.
function setup(callerModule) {
  const args = Object.fromEntries(process.argv.slice(2).reduce((acc, a, i, all) =>
    (a.startsWith('--') ? [...acc, [a.slice(2), all[i + 1]]] : acc), []));
  const source = path.resolve(args['source-dir'] || '.');
  callerModule.paths.unshift(path.join(source, '.tools', 'node_modules'));
  return { args, source };
}

// mulberry32 from `seed`, with the helpers the generators use.
function seeded(seed) {
  let state = seed | 0;
  const rand = () => {
    state = (state + 0x6d2b79f5) | 0;
    let t = Math.imul(state ^ (state >>> 15), 1 | state);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const int = (n) => Math.floor(rand() * n);
  return { rand, int, pick: (xs) => xs[int(xs.length)] };
}

module.exports = { setup, seeded };
