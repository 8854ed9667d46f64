// The schedule model (docs/artifacts.md): a few scalar ops on lr and step, in float64 (Adam's bias corrections),
// evaluated here in JavaScript's own float64 numbers. Not every onnxruntime-web bundle has float64 kernels (the
// native WebGPU bundle's CPU provider has no Cast to double), and a second session per step would cost more than
// the arithmetic.
import { fields, text } from './protobuf.js';

const FLOAT = 1;
const INT32 = 6;
const INT64 = 7;
const BOOL = 9;
const DOUBLE = 11;

/** @typedef {{type: number, value: number}} Scalar */

/** A value rounded to what its ONNX type holds. @param {number} type @param {number} v */
function held(type, v) {
  if (type === FLOAT) return Math.fround(v);
  if (type === INT32 || type === INT64) return Math.trunc(v);
  if (type === BOOL) return v ? 1 : 0;
  return v;
}

/** @type {Record<string, (a: number, b: number) => number>} */
const BINARY = {
  Add: (a, b) => a + b, Sub: (a, b) => a - b, Mul: (a, b) => a * b, Div: (a, b) => a / b, Pow: (a, b) => a ** b,
  Max: (a, b) => Math.max(a, b), Min: (a, b) => Math.min(a, b),
};
/** @type {Record<string, (a: number, b: number) => number>} */
const COMPARE = {
  Equal: (a, b) => Number(a === b), Less: (a, b) => Number(a < b), Greater: (a, b) => Number(a > b),
  LessOrEqual: (a, b) => Number(a <= b), GreaterOrEqual: (a, b) => Number(a >= b),
};
/** @type {Record<string, (a: number) => number>} */
const UNARY = {
  Sqrt: Math.sqrt, Neg: (a) => -a, Reciprocal: (a) => 1 / a, Exp: Math.exp, Log: Math.log, Abs: Math.abs,
  Identity: (a) => a, Not: (a) => Number(!a),
};

/** A TensorProto holding one value. @param {Uint8Array} bytes @returns {Scalar} */
function tensorScalar(bytes) {
  let type = 0;
  let count = 1;
  /** @type {number | null} */
  let value = null;
  for (const f of fields(bytes)) {
    if (f.field === 1) count *= f.value;                                 // dims
    else if (f.field === 2) type = f.value;
    else if (f.field === 4) value = new DataView(f.body.buffer, f.body.byteOffset).getFloat32(0, true);   // float_data
    else if ((f.field === 5 || f.field === 7) && f.wire === 0) value = f.value;                       // int32/int64_data
    else if (f.field === 5 || f.field === 7) value = [...fields(new Uint8Array([0x08, ...f.body]))][0].value;
    else if (f.field === 10) value = new DataView(f.body.buffer, f.body.byteOffset).getFloat64(0, true);  // double_data
    else if (f.field === 9) {                                                                          // raw_data
      const view = new DataView(f.body.buffer, f.body.byteOffset, f.body.byteLength);
      value = { [FLOAT]: () => view.getFloat32(0, true), [DOUBLE]: () => view.getFloat64(0, true),
        [INT32]: () => view.getInt32(0, true), [INT64]: () => Number(view.getBigInt64(0, true)),
        [BOOL]: () => view.getUint8(0) }[type]?.() ?? null;
    }
  }
  if (count !== 1 || value === null) throw new Error('the schedule model holds a constant that is not one number');
  return { type, value: held(type, value) };
}

/**
 * A node: op, inputs, outputs and the attributes a schedule uses (``to``, ``value``).
 * @param {Uint8Array} bytes
 */
function node(bytes) {
  /** @type {{op: string, inputs: string[], outputs: string[], to?: number, value?: Scalar}} */
  const n = { op: '', inputs: [], outputs: [] };
  for (const f of fields(bytes)) {
    if (f.field === 1) n.inputs.push(text.decode(f.body));
    if (f.field === 2) n.outputs.push(text.decode(f.body));
    if (f.field === 4) n.op = text.decode(f.body);
    if (f.field !== 5) continue;
    let name = '';
    let i = 0;
    /** @type {Uint8Array | null} */
    let t = null;
    for (const a of fields(f.body)) {
      if (a.field === 1) name = text.decode(a.body);
      if (a.field === 3) i = a.value;
      if (a.field === 5) t = a.body;
    }
    if (name === 'to') n.to = i;
    if (name === 'value' && t) n.value = tensorScalar(t);
  }
  return n;
}

/**
 * A schedule model compiled to a function of its scalar inputs.
 * @param {Uint8Array} model
 * @returns {(inputs: Record<string, Scalar>) => Record<string, Scalar>} the graph outputs' values
 */
export function compileSchedule(model) {
  const nodes = [];
  /** @type {Record<string, Scalar>} */
  const constants = {};
  /** @type {string[]} */
  const outputs = [];
  for (const f of fields(model)) {
    if (f.field !== 7) continue;
    for (const g of fields(f.body)) {
      if (g.field === 1) nodes.push(node(g.body));
      if (g.field === 5) {
        let name = '';
        for (const t of fields(g.body)) if (t.field === 8) name = text.decode(t.body);
        constants[name] = tensorScalar(g.body);
      }
      if (g.field === 12) for (const o of fields(g.body)) if (o.field === 1) outputs.push(text.decode(o.body));
    }
  }
  for (const n of nodes) {
    const known = n.op === 'Constant' || n.op === 'Cast' || n.op === 'Where' || n.op in BINARY || n.op in COMPARE
      || n.op in UNARY;
    if (!known) throw new Error(`the schedule model has a ${n.op} node, which this evaluator does not compute`);
  }
  return (inputs) => {
    /** @type {Record<string, Scalar>} */
    const v = { ...constants, ...inputs };
    for (const n of nodes) {
      const x = n.inputs.map((name) => v[name]);
      /** @type {Scalar} */
      let y;
      if (n.op === 'Constant') y = /** @type {Scalar} */ (n.value);
      else if (n.op === 'Cast') y = { type: /** @type {number} */ (n.to), value: held(/** @type {number} */ (n.to), x[0].value) };
      else if (n.op === 'Where') y = x[0].value ? x[1] : x[2];
      else if (n.op in COMPARE) y = { type: BOOL, value: COMPARE[n.op](x[0].value, x[1].value) };
      else if (n.op in UNARY) y = { type: x[0].type, value: held(x[0].type, UNARY[n.op](x[0].value)) };
      else y = { type: x[0].type, value: held(x[0].type, BINARY[n.op](x[0].value, x[1].value)) };
      v[n.outputs[0]] = y;
    }
    /** @type {Record<string, Scalar>} */
    const out = {};
    for (const name of outputs) out[name] = v[name];
    return out;
  };
}
