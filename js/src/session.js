// A training session over onnxgrad's artifacts (docs/artifacts.md) for any onnxruntime with the
// onnxruntime-common API: onnxruntime-web (wasm, WebGPU) and onnxruntime-node. The caller passes its ort module.
import { ELEM_TYPES, readModel, withInitializers } from './onnx.js';
import { compileSchedule } from './schedule.js';
import { ARRAYS, arrayOf } from './safetensors.js';
import { readState, writeState } from './state.js';

/** @typedef {import('onnxruntime-common').Tensor} Tensor */
/** @typedef {import('onnxruntime-common').InferenceSession} InferenceSession */
/** @typedef {typeof import('onnxruntime-common')} Ort */

/**
 * A batch: each data input's tensor, as an ort Tensor or as ``{data, dims}`` (a typed array or array).
 * @typedef {Record<string, Tensor | {data: ArrayLike<number|bigint|boolean>, dims: number[]}>} Batch
 */

/** A step whose loss or gradient was not finite: the graph kept the old parameters. */
export class NonFiniteError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = 'NonFiniteError';
  }
}

/** A batch or option that does not fit the artifacts: names the input and what to do. */
export class TrainingError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = 'TrainingError';
  }
}

/** The typed array holding an ONNX element type's values (its safetensors dtype's). @param {number} elemType */
function arrayType(elemType) {
  return ARRAYS[ELEM_TYPES[/** @type {keyof typeof ELEM_TYPES} */ (elemType)].safetensors];
}

/** @param {ArrayBufferView} data */
function bytesOf(data) {
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
}

/**
 * Options of {@link TrainingSession.create}.
 * @typedef {object} Options
 * @property {string} [executionProvider] 'wasm' or 'webgpu' (onnxruntime-web), 'cpu' (onnxruntime-node); default
 *   'cpu' where ort has no 'webgpu' or 'wasm' backend else 'wasm'
 * @property {'raise'|'skip'} [onNonfinite] what a step with a non-finite loss or gradient does (default 'raise')
 * @property {Record<string, any>} [sessionOptions] more onnxruntime session options
 */

export class TrainingSession {
  /**
   * Load the artifacts and a state file (the CLI's initial state or any checkpoint).
   * @param {Ort} ort onnxruntime-web's or onnxruntime-node's module
   * @param {{train: Uint8Array, state: Uint8Array, eval?: Uint8Array, schedule?: Uint8Array}} files
   * @param {Options} [options]
   */
  static async create(ort, files, options = {}) {
    const s = new TrainingSession(ort, files, options);
    await s.#open(files);
    return s;
  }

  /** @type {Ort} */ #ort;
  /** @type {string} */ #ep;
  /** @type {'raise'|'skip'} */ #onNonfinite;
  /** @type {Record<string, any>} */ #sessionOptions;
  /** @type {InferenceSession | null} */ #train = null;
  /** @type {((inputs: Record<string, import('./schedule.js').Scalar>) => Record<string, import('./schedule.js').Scalar>) | null} the schedule model, compiled */
  #schedule = null;
  /** @type {InferenceSession | null} */ #eval = null;
  /** @type {Uint8Array | undefined} */ #evalBytes;
  /** @type {Map<string, import('./onnx.js').ValueInfo>} */ #trainInputs = new Map();
  /** @type {Map<string, import('./onnx.js').ValueInfo>} */ #evalInputs = new Map();
  /** @type {Map<string, import('./onnx.js').ValueInfo>} */ #scheduleInputs = new Map();
  /** @type {Map<string, Tensor>} the state tensors by training input name (on the GPU after a WebGPU step) */
  #state = new Map();
  /** @type {Map<string, import('./safetensors.js').Entry>} tensors of the file this session does not use */
  #kept = new Map();
  /** @type {Record<string, string>} */ #metadata = {};
  /** @type {Map<string, string>} training output -> the state input it updates */
  #feedback = new Map();
  /** @type {import('./state.js').Spec} */ spec;
  /** The learning rate of the next update. */
  lr = 0;
  /** Updates applied so far. */
  stepCount = 0;
  /** Steps skipped as non-finite (``onNonfinite: 'skip'``). */
  skippedSteps = 0;

  /** @param {Ort} ort @param {{train: Uint8Array, state: Uint8Array, eval?: Uint8Array}} files @param {Options} options */
  constructor(ort, files, options) {
    this.#ort = ort;
    const backends = typeof ort.listSupportedBackends === 'function' ? ort.listSupportedBackends() : [];
    const names = backends.map((/** @type {{name: string}} */ b) => b.name);
    this.#ep = options.executionProvider ?? (names.includes('wasm') ? 'wasm' : 'cpu');
    this.#onNonfinite = options.onNonfinite ?? 'raise';
    this.#sessionOptions = options.sessionOptions ?? {};
    this.#evalBytes = files.eval;
    this.spec = /** @type {any} */ (null);
  }

  /** The execution provider with its options: WebGPU keeps the models' NCHW layout (converting to its preferred
   * NHWC put a weight's Transpose on the CPU inside the step). */
  #provider() {
    return this.#ep === 'webgpu' ? { name: 'webgpu', preferredLayout: 'NCHW' } : this.#ep;
  }

  /** Where the step runs: the execution provider's name. */
  get executionProvider() {
    return this.#ep;
  }

  /** @param {{train: Uint8Array, state: Uint8Array, schedule?: Uint8Array}} files */
  async #open(files) {
    const { spec, tensors, metadata } = await readState(files.state);
    this.spec = spec;
    for (const i of readModel(files.train).inputs) this.#trainInputs.set(i.name, i);
    const feedback = this.#feedback;
    for (const [p, out] of Object.entries(spec.params)) feedback.set(out, p);
    for (const states of Object.values(spec.state ?? {})) {
      for (const [input, out] of Object.values(states)) feedback.set(out, input);
    }
    for (const [input, out] of Object.values(spec.buffers ?? {})) feedback.set(out, input);
    if ((spec.accumulation_steps ?? 1) > 1) {
      throw new TrainingError(`these artifacts accumulate gradients over ${spec.accumulation_steps} micro-batches, `
        + 'which this session does not run: write them without --accumulation-steps (a larger batch per step)');
    }
        if (spec.schedule?.outputs?.length && !files.schedule) {
      throw new TrainingError('these artifacts were built for the webgpu target: pass their schedule model as '
        + 'files.schedule (<stem>.schedule.onnx)');
    }
    // the state tensors stay where their values live; the loss and verdict come back to the CPU
    const location = this.#ep === 'webgpu' ? 'gpu-buffer' : 'cpu';
    /** @type {Record<string, string>} */
    const outputs = {};
    for (const out of feedback.keys()) outputs[out] = location;
    outputs[spec.loss] = 'cpu';
    outputs[spec.finite] = 'cpu';
    this.#train = await this.#ort.InferenceSession.create(files.train, {
      executionProviders: [this.#provider()], ...this.#sessionOptions,
      ...(this.#ep === 'webgpu' ? { preferredOutputLocation: outputs } : {}),
    });
    if (files.schedule) {
      for (const i of readModel(files.schedule).inputs) this.#scheduleInputs.set(i.name, i);
      this.#schedule = compileSchedule(files.schedule);
    }
    this.#load(tensors, metadata);
  }

  /**
   * Take the state file's tensors as the current state.
   * @param {Map<string, import('./safetensors.js').Entry>} tensors
   * @param {Record<string, string>} metadata
   */
  #load(tensors, metadata) {
    const spec = this.spec;
    const wanted = new Set([...this.#feedback.values()]);
    const missing = [...wanted].filter((name) => !tensors.has(name));
    if (missing.length) {
      throw new TrainingError(`the state file lacks ${missing.slice(0, 5).join(', ')}`
        + `${missing.length > 5 ? ` and ${missing.length - 5} more` : ''}: write it for these artifacts`);
    }
    this.#dispose();
    this.#kept = new Map();
    for (const [name, entry] of tensors) {
      if (!wanted.has(name)) {
        if (name !== spec.lr && name !== spec.step) this.#kept.set(name, entry);
        continue;
      }
      const input = this.#trainInputs.get(name);
      const type = input ? ELEM_TYPES[/** @type {keyof typeof ELEM_TYPES} */ (input.elemType)].ort : null;
      const fileType = Object.values(ELEM_TYPES).find((t) => t.safetensors === entry.dtype)?.ort;
      if (!fileType || (type && type !== fileType)) {
        throw new TrainingError(`state tensor '${name}' is ${entry.dtype}; the training model reads ${type}`);
      }
      this.#state.set(name, new this.#ort.Tensor(/** @type {any} */ (fileType), arrayOf(entry),
        entry.shape));
    }
    const lr = tensors.get(spec.lr);
    const step = tensors.get(spec.step);
    if (!lr || !step) throw new TrainingError(`the state file lacks '${spec.lr}' or '${spec.step}'`);
    this.lr = Number(arrayOf(lr)[0]);
    this.stepCount = Number(arrayOf(step)[0]) - 1;
    this.#metadata = { ...metadata };
    delete this.#metadata.session;         // a Python session's counters: not true once this one has stepped
  }

  /** @param {string} name @param {number} value a 0-d tensor of the type the training model reads */
  #scalar(name, value) {
    return this.#tensor((this.#trainInputs.get(name) ?? this.#scheduleInput(name)).elemType, value);
  }

  /** @param {number} elemType @param {number} value a 0-d tensor of that ONNX type */
  #tensor(elemType, value) {
    const type = ELEM_TYPES[/** @type {keyof typeof ELEM_TYPES} */ (elemType)].ort;
    const data = type === 'int64' ? BigInt64Array.of(BigInt(value)) : new (arrayType(elemType))([value]);
    return new this.#ort.Tensor(/** @type {any} */ (type), data, []);
  }

  /** @param {string} name */
  #scheduleInput(name) {
    const input = this.#scheduleInputs.get(name);
    if (!input) throw new TrainingError(`neither the training nor the schedule model has an input '${name}'`);
    return input;
  }

  /**
   * The batch's tensors typed as ``inputs`` declares them (int64 labels to an int32 input and back, lossless and
   * range-checked; nothing else converted).
   * @param {Batch} batch @param {Map<string, import('./onnx.js').ValueInfo>} inputs
   * @returns {Record<string, Tensor>}
   */
  #batchFeeds(batch, inputs) {
    /** @type {Record<string, Tensor>} */
    const feeds = {};
    for (const name of this.spec.data_inputs) {
      const input = inputs.get(name);
      if (!input) continue;                        // the eval model reads only some of them
      const given = batch[name];
      if (given === undefined) throw new TrainingError(`the batch has no '${name}': it needs ${this.spec.data_inputs.join(', ')}`);
      const want = ELEM_TYPES[/** @type {keyof typeof ELEM_TYPES} */ (input.elemType)].ort;
      const dims = 'dims' in given ? [...given.dims] : [];
      let data = /** @type {any} */ (given).data;
      const have = given instanceof this.#ort.Tensor ? given.type : null;
      if (have === want && given instanceof this.#ort.Tensor) {
        feeds[name] = given;
        continue;
      }
      if ((have === 'int64' || data instanceof BigInt64Array) && want === 'int32') {
        data = Int32Array.from(data, (/** @type {bigint} */ v) => {
          if (v > 2147483647n || v < -2147483648n) throw new TrainingError(`'${name}' holds ${v}, beyond int32`);
          return Number(v);
        });
      } else if (want === 'int64') {
        data = data instanceof BigInt64Array ? data : BigInt64Array.from(data, (/** @type {number} */ v) => BigInt(v));
      } else if (have && have !== want) {
        throw new TrainingError(`'${name}' is ${have}; the model reads ${want}: convert it before the step`);
      } else if (!ArrayBuffer.isView(data)) {
        data = new (arrayType(input.elemType))(data);
      }
      const count = dims.reduce((a, b) => a * b, 1);
      if (data.length !== count) throw new TrainingError(`'${name}' has ${data.length} values for dims [${dims}]`);
      feeds[name] = new this.#ort.Tensor(/** @type {any} */ (want), data, dims);
    }
    return feeds;
  }

  /**
   * One update on ``batch``: returns its loss (before the update).
   * @param {Batch} batch
   * @returns {Promise<number>}
   */
  async step(batch) {
    const spec = this.spec;
    const train = /** @type {InferenceSession} */ (this.#train);
    /** @type {Record<string, Tensor>} */
    const feeds = this.#batchFeeds(batch, this.#trainInputs);
    const step = this.stepCount + 1;
    if (this.#schedule) {            // the step's float64 scalars, computed here (docs/artifacts.md)
      /** @type {Record<string, import('./schedule.js').Scalar>} */
      const scalars = {};
      for (const [name, input] of this.#scheduleInputs) {
        scalars[name] = { type: input.elemType, value: name === spec.lr ? Math.fround(this.lr) : step };
      }
      for (const [name, { type, value }] of Object.entries(this.#schedule(scalars))) {
        if (this.#trainInputs.has(name)) feeds[name] = this.#tensor(type, value);
      }
    }
    for (const name of [spec.lr, spec.step]) {
      if (this.#trainInputs.has(name)) feeds[name] = this.#scalar(name, name === spec.lr ? this.lr : step);
    }
    for (const [name, tensor] of this.#state) if (this.#trainInputs.has(name)) feeds[name] = tensor;
    const results = await train.run(feeds, [spec.loss, spec.finite, ...this.#feedback.keys()]);
    const loss = Number(results[spec.loss].data[0]);
    const finite = Boolean(results[spec.finite].data[0]);
    for (const [out, input] of this.#feedback) {     // the guarded graph returned the old values when not finite
      const old = this.#state.get(input);
      this.#state.set(input, results[out]);
      if (old && old !== results[out] && old.location === 'gpu-buffer') old.dispose();
    }
    if (finite) {
      this.stepCount += 1;
    } else if (this.#onNonfinite === 'raise') {
      throw new NonFiniteError(`step ${step}: the loss (${loss}) or a gradient is not finite; the parameters are `
        + "unchanged (onNonfinite: 'skip' skips such steps)");
    } else {
      this.skippedSteps += 1;
    }
    return loss;
  }

  /**
   * The eval model's outputs on ``batch`` with the current parameters and running statistics (on the CPU).
   * @param {Batch} batch
   * @returns {Promise<Record<string, Tensor>>}
   */
  async eval(batch) {
    if (!this.#evalBytes) throw new TrainingError('no eval model: pass files.eval (<stem>.eval.onnx) to create()');
    if (!this.#eval) {
      for (const i of readModel(this.#evalBytes).inputs) this.#evalInputs.set(i.name, i);
      this.#eval = await this.#ort.InferenceSession.create(this.#evalBytes, {
        executionProviders: [this.#provider()], ...this.#sessionOptions,
      });
    }
    const feeds = this.#batchFeeds(batch, this.#evalInputs);
    for (const [name, tensor] of this.#state) if (this.#evalInputs.has(name)) feeds[name] = tensor;
    const results = await this.#eval.run(feeds);
    /** @type {Record<string, Tensor>} */
    const out = {};
    for (const [name, t] of Object.entries(results)) {
      out[name] = t.location === 'cpu' ? t : new this.#ort.Tensor(/** @type {any} */ (t.type), await t.getData(true), t.dims);
    }
    return out;
  }

  /** Every state tensor's current value on the CPU, by input name. */
  async #current() {
    /** @type {Map<string, {type: string, dims: readonly number[], data: ArrayBufferView}>} */
    const out = new Map();
    for (const [name, t] of this.#state) {
      const data = t.location === 'cpu' ? t.data : await t.getData();
      out.set(name, { type: t.type, dims: t.dims, data: /** @type {ArrayBufferView} */ (data) });
    }
    return out;
  }

  /** The parameters' current values (CPU typed arrays), by name. */
  async parameters() {
    const current = await this.#current();
    /** @type {Record<string, ArrayBufferView>} */
    const out = {};
    for (const p of Object.keys(this.spec.params)) out[p] = /** @type {ArrayBufferView} */ (current.get(p)?.data);
    return out;
  }

  /**
   * A checkpoint: the state file with the current values (Python's TrainingSession.restore reads it).
   * @returns {Promise<Uint8Array>}
   */
  async save() {
    const spec = this.spec;
    /** @type {Map<string, import('./safetensors.js').Entry>} */
    const tensors = new Map(this.#kept);
    for (const [name, { type, dims, data }] of await this.#current()) {
      const dtype = /** @type {any} */ (Object.values(ELEM_TYPES).find((t) => t.ort === type)?.safetensors);
      tensors.set(name, { dtype, shape: [...dims], bytes: bytesOf(data) });
    }
    tensors.set(spec.lr, { dtype: 'F32', shape: [], bytes: bytesOf(Float32Array.of(this.lr)) });
    const stepType = this.#trainInputs.get(spec.step)?.elemType ?? this.#scheduleInput(spec.step).elemType;
    const next = this.stepCount + 1;
    tensors.set(spec.step, stepType === 7
      ? { dtype: 'I64', shape: [], bytes: bytesOf(BigInt64Array.of(BigInt(next))) }
      : { dtype: 'I32', shape: [], bytes: bytesOf(Int32Array.of(next)) });
    return writeState(tensors, this.#metadata);
  }

  /**
   * Continue from a checkpoint of these artifacts (this session's, Python's or the CLI's initial state).
   * @param {Uint8Array} file
   */
  async restore(file) {
    const { tensors, metadata, spec } = await readState(file);
    if (JSON.stringify(Object.keys(spec.params).sort()) !== JSON.stringify(Object.keys(this.spec.params).sort())
        || spec.optimizer?.type !== this.spec.optimizer?.type) {
      throw new TrainingError('the checkpoint belongs to other artifacts: its parameters or optimizer differ');
    }
    this.#load(tensors, metadata);       // step in either integer type: a checkpoint of another target's artifacts
  }

  /**
   * The trained inference model: the eval model with the current parameters and running statistics as its
   * initializers (ONNX bytes, for any runtime).
   * @returns {Promise<Uint8Array>}
   */
  async exportModel() {
    if (!this.#evalBytes) throw new TrainingError('no eval model: pass files.eval (<stem>.eval.onnx) to create()');
    const inputs = new Set(readModel(this.#evalBytes).inputs.map((i) => i.name));
    /** @type {Map<string, {elemType: number, dims: number[], bytes: Uint8Array}>} */
    const values = new Map();
    for (const [name, { type, dims, data }] of await this.#current()) {
      if (!inputs.has(name)) continue;
      const elemType = Number(Object.entries(ELEM_TYPES).find(([, t]) => t.ort === type)?.[0]);
      values.set(name, { elemType, dims: [...dims], bytes: bytesOf(data).slice() });
    }
    return withInitializers(this.#evalBytes, values);
  }

  #dispose() {
    for (const t of this.#state.values()) if (t.location === 'gpu-buffer') t.dispose();
    this.#state.clear();
  }

  /** Free the sessions and the state's GPU buffers. */
  async release() {
    this.#dispose();
    for (const s of [this.#train, this.#eval]) if (s) await s.release();
  }
}
