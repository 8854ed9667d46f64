// The few parts of an ONNX model (protobuf) the session needs, read and written with no dependency: the main
// graph's inputs and outputs with their types, the model's metadata, and a copy of the model whose given inputs
// become initializers (the trained inference model). Field numbers are onnx.proto's.

import { concat, encodeVarint, fields, lengthDelimited, text } from './protobuf.js';

/** ONNX TensorProto.DataType -> onnxruntime-common's tensor type and safetensors' dtype. */
export const ELEM_TYPES = Object.freeze({
  1: { ort: 'float32', safetensors: 'F32' },
  2: { ort: 'uint8', safetensors: 'U8' },
  3: { ort: 'int8', safetensors: 'I8' },
  6: { ort: 'int32', safetensors: 'I32' },
  7: { ort: 'int64', safetensors: 'I64' },
  9: { ort: 'bool', safetensors: 'BOOL' },
  10: { ort: 'float16', safetensors: 'F16' },
  11: { ort: 'float64', safetensors: 'F64' },
});

/**
 * A graph input or output: its name, element type (TensorProto.DataType) and dims (a number, or the symbolic
 * name, or null where unknown).
 * @typedef {{name: string, elemType: number, dims: (number|string|null)[] | null}} ValueInfo
 */

/** @param {Uint8Array} bytes @returns {ValueInfo} */
function valueInfo(bytes) {
  /** @type {ValueInfo} */
  const info = { name: '', elemType: 0, dims: null };
  for (const f of fields(bytes)) {
    if (f.field === 1) info.name = text.decode(f.body);
    if (f.field !== 2) continue;                                   // ValueInfoProto.type
    for (const t of fields(f.body)) {
      if (t.field !== 1) continue;                                 // TypeProto.tensor_type
      for (const tt of fields(t.body)) {
        if (tt.field === 1) info.elemType = tt.value;
        if (tt.field !== 2) continue;                              // TypeProto.Tensor.shape
        info.dims = [];
        for (const d of fields(tt.body)) {
          if (d.field !== 1) continue;                             // TensorShapeProto.dim
          let dim = null;
          for (const v of fields(d.body)) {
            if (v.field === 1) dim = v.value;                      // dim_value
            if (v.field === 2) dim = text.decode(v.body);          // dim_param
          }
          info.dims.push(dim);
        }
      }
    }
  }
  return info;
}

/**
 * The main graph's inputs and outputs, and the model's metadata_props.
 * @param {Uint8Array} model
 * @returns {{inputs: ValueInfo[], outputs: ValueInfo[], initializers: string[], metadata: Record<string, string>}}
 */
export function readModel(model) {
  /** @type {ValueInfo[]} */ const inputs = [];
  /** @type {ValueInfo[]} */ const outputs = [];
  /** @type {string[]} */ const initializers = [];
  /** @type {Record<string, string>} */ const metadata = {};
  for (const f of fields(model)) {
    if (f.field === 14) {                                          // ModelProto.metadata_props
      let key = '';
      let value = '';
      for (const e of fields(f.body)) {
        if (e.field === 1) key = text.decode(e.body);
        if (e.field === 2) value = text.decode(e.body);
      }
      metadata[key] = value;
    }
    if (f.field !== 7) continue;                                   // ModelProto.graph
    for (const g of fields(f.body)) {
      if (g.field === 11) inputs.push(valueInfo(g.body));
      if (g.field === 12) outputs.push(valueInfo(g.body));
      if (g.field === 5) {                                         // GraphProto.initializer: its name (8)
        for (const t of fields(g.body)) if (t.field === 8) initializers.push(text.decode(t.body));
      }
    }
  }
  const held = new Set(initializers);
  return { inputs: inputs.filter((i) => !held.has(i.name)), outputs, initializers, metadata };
}

/**
 * A TensorProto: dims, data_type, name, raw_data (little-endian bytes).
 * @param {string} name @param {number} elemType @param {number[]} dims @param {Uint8Array} raw
 */
function tensorProto(name, elemType, dims, raw) {
  const head = [];
  for (const d of dims) head.push(...encodeVarint(1 * 8), ...encodeVarint(d));
  head.push(...encodeVarint(2 * 8), ...encodeVarint(elemType));
  return concat([new Uint8Array(head), lengthDelimited(8, new TextEncoder().encode(name)), lengthDelimited(9, raw)]);
}

/**
 * ``model`` with each of ``values``' names, a graph input, held as an initializer of that value instead.
 * @param {Uint8Array} model
 * @param {Map<string, {elemType: number, dims: number[], bytes: Uint8Array}>} values
 * @returns {Uint8Array}
 */
export function withInitializers(model, values) {
  const parts = [];
  for (const f of fields(model)) {
    if (f.field !== 7) {
      parts.push(model.subarray(f.start, f.end));
      continue;
    }
    const graph = [];
    for (const g of fields(f.body)) {
      if (g.field === 11 && values.has(valueInfo(g.body).name)) continue;    // the input becomes an initializer
      graph.push(f.body.subarray(g.start, g.end));
    }
    for (const [name, { elemType, dims, bytes }] of values) {
      graph.push(lengthDelimited(5, tensorProto(name, elemType, dims, bytes)));
    }
    parts.push(lengthDelimited(7, concat(graph)));
  }
  return concat(parts);
}
