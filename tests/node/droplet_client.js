// Drives the real published droplet Node client (droplet@1.4.0) against
// Tollgate's droplet endpoint at ws://HOST:PORT (argv[2], argv[3]).
//
// The server runs on a manual clock that the Rust test (tests/droplet_node.rs)
// owns: to let time pass, this script prints {"advance_ms": N} on a line of
// its own and waits for one line on stdin, which the test writes once it has
// moved the clock. The last line printed is {"results": {...}}, on which the
// test asserts.
'use strict';

const droplet = require('droplet');
const readline = require('readline');

// droplet's client logs with bunyan to stdout by default; stdout is ours.
const silent = {};
for (const level of ['trace', 'debug', 'info', 'warn', 'error', 'fatal']) silent[level] = () => {};
silent.child = () => silent;

const stdin = readline.createInterface({ input: process.stdin });
const stdinLines = [];
const stdinWaiters = [];
stdin.on('line', line => {
  const waiter = stdinWaiters.shift();
  if (waiter) waiter(line); else stdinLines.push(line);
});

function advance(ms) {
  process.stdout.write(JSON.stringify({ advance_ms: ms }) + '\n');
  return new Promise(resolve => {
    if (stdinLines.length > 0) resolve(stdinLines.shift()); else stdinWaiters.push(resolve);
  });
}

// The fields of a decoded Droplet.Response, as the client hands them over
// (protobufjs fills absent optional fields with their default).
function fields(result) {
  const out = {};
  for (const name of ['accept', 'ls', 'lm', 'lh', 'ld', 'lw', 'lo']) {
    if (result[name] !== undefined && result[name] !== null) out[name] = result[name];
  }
  return out;
}

async function main() {
  const url = `ws://${process.argv[2]}:${process.argv[3]}`;
  const client = droplet.create_client({ url, logger: silent, max_reconnect: 3, reconnect_delay: 100 });
  let nextId = 0;
  const take = payload => new Promise((resolve, reject) => {
    client.take(Object.assign({ id: String(++nextId) }, payload),
      (error, result) => error ? reject(error) : resolve(fields(result)));
  });
  const query = payload => new Promise((resolve, reject) => {
    client.query(Object.assign({ id: String(++nextId) }, payload),
      (error, result) => error ? reject(error) : resolve(fields(result)));
  });

  const results = {};
  results.take = await take({ bucket: 'a', ls: 10 });
  results.take_count = await take({ bucket: 'b', ls: 10, count: 4 });
  results.drain = await take({ bucket: 'c', ls: 3, count: 3 });
  results.overtake = await take({ bucket: 'c', ls: 3 });
  results.reset = await take({ bucket: 'c', ls: 3, reset: true });
  results.persist_first = await take({ bucket: 'd', ls: 5, lm: 100 });
  results.persist_second = await take({ bucket: 'd', ls: 5 });
  results.persist_query = await query({ bucket: 'd' });
  results.negative_count = [
    await take({ bucket: 'g', ls: 10, count: 5 }),
    await take({ bucket: 'g', ls: 10, count: -3 }),
    await take({ bucket: 'g', ls: 10, count: -30 }),
  ];
  results.empty = await take({ bucket: 'e', ls: 10, count: 10 });
  await advance(250);
  results.after_250ms = await take({ bucket: 'e', ls: 10, count: 0 });
  results.after_250ms_query = await query({ bucket: 'e' });
  await advance(10000);
  results.after_10s_query = await query({ bucket: 'e' });
  results.pipelined = (await Promise.all(
    Array.from({ length: 20 }, () => take({ bucket: 'f', lm: 100 })))).map(r => r.lm);
  client.close();
  stdin.close();
  process.stdout.write(JSON.stringify({ results }) + '\n');
}

main().catch(error => {
  process.stderr.write(`droplet client failed: ${error && error.stack || error}\n`);
  process.exit(1);
});
