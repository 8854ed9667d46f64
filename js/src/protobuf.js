// Protobuf's wire format, the little of it ONNX files need: read a message's fields, write length-delimited ones.

/** @param {Uint8Array} bytes @param {number} at @returns {[number, number]} the varint and the next offset */
function varint(bytes, at) {
  let value = 0;
  let scale = 1;
  for (;;) {
    const b = bytes[at++];
    value += (b & 0x7f) * scale;
    if (b < 0x80) return [value, at];
    scale *= 128;
  }
}

/**
 * The fields of one protobuf message, in order: field number, wire type, and where the value lies.
 * @param {Uint8Array} bytes
 * @returns {Generator<{field: number, wire: number, start: number, end: number, value: number, body: Uint8Array}>}
 */
export function* fields(bytes) {
  let at = 0;
  while (at < bytes.length) {
    const start = at;
    let tag;
    [tag, at] = varint(bytes, at);
    const field = Math.floor(tag / 8);
    const wire = tag % 8;
    let value = 0;
    let body = bytes.subarray(at, at);
    if (wire === 0) {
      [value, at] = varint(bytes, at);
    } else if (wire === 1) {
      at += 8;
    } else if (wire === 5) {
      at += 4;
    } else if (wire === 2) {
      let length;
      [length, at] = varint(bytes, at);
      body = bytes.subarray(at, at + length);
      at += length;
    } else {
      throw new Error(`not an ONNX model: protobuf wire type ${wire} at byte ${start}`);
    }
    yield { field, wire, start, end: at, value, body };
  }
}

export const text = new TextDecoder();

/** @param {number} n @returns {number[]} */
export function encodeVarint(n) {
  const out = [];
  while (n >= 0x80) {
    out.push((n % 128) | 0x80);
    n = Math.floor(n / 128);
  }
  out.push(n);
  return out;
}

/** @param {number} field @param {Uint8Array} body @returns {Uint8Array} a length-delimited field */
export function lengthDelimited(field, body) {
  const head = [...encodeVarint(field * 8 + 2), ...encodeVarint(body.length)];
  const out = new Uint8Array(head.length + body.length);
  out.set(head);
  out.set(body, head.length);
  return out;
}

/** @param {Uint8Array[]} parts */
export function concat(parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}
