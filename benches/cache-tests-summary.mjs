// The table of benches/cache-tests.sh: per section of the HTTP caching test suite, each proxy's
// passed / failed / optional-failed counts, and the tests the candidate (tollgate) fails.
//
//   node benches/cache-tests-summary.mjs SUITE_DIR RESULTS_DIR name=version [name=version ...]
//
// RESULTS_DIR holds one NAME.json a proxy, the suite client's output. Each result is classified
// by the suite's own rules (test-engine/lib/results.mjs, dependencies honoured, as cache-tests.fyi
// shows them): pass, fail (a required test failed), optional (an "optimal" test failed: the cache
// could have reused a stored answer and did not), check yes/no (behaviour surveyed, no right
// answer), dep (a test it depends on did not pass, so it says nothing), setup/harness/retry (the
// run itself went wrong). A proxy's failed count is what to compare; setup and harness counts
// should be zero.
import fs from 'node:fs'
import path from 'node:path'
import { pathToFileURL } from 'node:url'

const [suiteDir, resultsDir, ...named] = process.argv.slice(2)
if (!suiteDir || !resultsDir || named.length === 0) {
  console.error('usage: cache-tests-summary.mjs SUITE_DIR RESULTS_DIR name=version ...')
  process.exit(2)
}
const load = rel => import(pathToFileURL(path.join(suiteDir, rel)).href)
const suites = (await load('tests/index.mjs')).default
const { determineTestResult, resultTypes } = await load('test-engine/lib/results.mjs')

const proxies = named.map(arg => {
  const [name, version = ''] = arg.split('=')
  const results = JSON.parse(fs.readFileSync(path.join(resultsDir, `${name}.json`), 'utf8'))
  return { name, version, results }
})
const candidate = proxies.find(p => p.name === 'tollgate')

const kindOf = new Map([
  [resultTypes.pass, 'pass'], [resultTypes.fail, 'fail'], [resultTypes.optional_fail, 'optional'],
  [resultTypes.yes, 'yes'], [resultTypes.no, 'no'], [resultTypes.dependency_fail, 'dep'],
  [resultTypes.setup_fail, 'setup'], [resultTypes.harness_fail, 'harness'],
  [resultTypes.retry, 'retry'], [resultTypes.untested, 'untested']
])
const classify = (proxy, id) => kindOf.get(determineTestResult(suites, id, proxy.results)) || 'harness'
const zero = () => ({ pass: 0, fail: 0, optional: 0, yes: 0, no: 0, dep: 0, setup: 0, harness: 0, retry: 0, untested: 0 })

const rows = []
const total = proxies.map(zero)
for (const suite of suites) {
  const counts = proxies.map(zero)
  let n = 0
  for (const test of suite.tests) {
    if (test.browser_only === true) continue // the client never runs these against a proxy
    n++
    proxies.forEach((p, i) => { counts[i][classify(p, test.id)]++ })
  }
  if (n === 0) continue
  counts.forEach((c, i) => { for (const k in c) total[i][k] += c[k] })
  rows.push([suite.name, n, counts])
}

const cell = c => {
  const other = ['yes', 'no', 'dep', 'setup', 'harness', 'retry', 'untested']
    .filter(k => c[k] > 0).map(k => `${c[k]} ${k}`).join(', ')
  return `${c.pass} / ${c.fail} / ${c.optional}` + (other ? ` (${other})` : '')
}
const header = proxies.map(p => p.version ? `${p.name} ${p.version}` : p.name)
console.log('Passed / failed / optional-failed per section; in brackets: checks answered yes or no (no right answer), ' +
  'tests not counted because a test they depend on did not pass (dep), and runs that went wrong (setup, harness, retry).')
console.log()
console.log(`| section | tests | ${header.join(' | ')} |`)
console.log(`|---|---|${proxies.map(() => '---').join('|')}|`)
for (const [name, n, counts] of rows) console.log(`| ${name} | ${n} | ${counts.map(cell).join(' | ')} |`)
const n = rows.reduce((a, r) => a + r[1], 0)
console.log(`| **all** | ${n} | ${total.map(c => `**${cell(c)}**`).join(' | ')} |`)

if (candidate) {
  const others = proxies.filter(p => p !== candidate)
  const failed = []
  for (const suite of suites) {
    for (const test of suite.tests) {
      if (test.browser_only === true) continue
      const kind = classify(candidate, test.id)
      if (['pass', 'yes', 'no', 'dep'].includes(kind)) continue
      const raw = candidate.results[test.id]
      const message = Array.isArray(raw) ? raw.slice(0, 2).join(': ') : String(raw)
      failed.push([test.id, test.name, kind, message, others.map(p => classify(p, test.id))])
    }
  }
  const esc = s => String(s).replace(/\|/g, '\\|').replace(/\n/g, ' ')
  console.log()
  console.log(`${candidate.name} fails ${failed.filter(f => f[2] === 'fail').length} required tests` +
    ` and ${failed.filter(f => f[2] === 'optional').length} optional ones` +
    (failed.some(f => !['fail', 'optional'].includes(f[2])) ? ', and some went wrong (setup, harness, retry):' : ':'))
  console.log()
  console.log(`| id | name | result | suite's message | ${others.map(p => p.name).join(' | ')} |`)
  console.log(`|---|---|---|---|${others.map(() => '---').join('|')}|`)
  for (const [id, name, kind, message, theirs] of failed) {
    console.log(`| \`${id}\` | ${esc(name)} | ${kind} | ${esc(message)} | ${theirs.join(' | ')} |`)
  }
}
