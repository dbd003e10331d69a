// Drives the real published divvy Node client (@button/divvy-client@1.0.1)
// against a running tollgate at HOST:PORT (argv[2], argv[3]) and prints what
// it saw as one JSON line. The Rust test tests/node_clients.rs asserts on it.
'use strict';

const Client = require('@button/divvy-client');

async function main() {
  const host = process.argv[2];
  const port = Number(process.argv[3]);
  const client = new Client(host, port, { defaultCommandTimeoutMillis: 5000 });
  client.connect();
  const results = {};

  // The README walkthrough, with keys the client sorts and quotes.
  results.status = await client.hit({ path: '/status', method: 'GET' });
  results.cookies = [];
  for (let i = 0; i < 4; i++) {
    results.cookies.push(await client.hit({ method: 'GET', path: '/pantry/cookies/oatmeal', ip: '10.1.2.3' }));
  }
  results.denied = await client.hit({ method: 'POST', path: '/x' });
  // Values holding '=' survive quoting; numbers are sent as text.
  results.quoted = await client.hit({ method: 'GET', path: '/pantry/cookies/a=b', ip: '10.9.9.9' });
  // Pipelined: many hits in flight at once, answered in FIFO order.
  const pipelined = await Promise.all(
    Array.from({ length: 50 }, () => client.hit({ method: 'GET', path: '/status' })));
  results.pipelined_credits = pipelined.map(r => r.currentCredit);
  client.close();
  process.stdout.write(JSON.stringify(results) + '\n');
}

main().catch(err => {
  process.stderr.write(`divvy client failed: ${err && err.stack || err}\n`);
  process.exit(1);
});
