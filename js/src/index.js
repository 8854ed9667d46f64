// onnxgrad's JavaScript side: train the artifacts `python -m onnxgrad` writes, in browsers and Node.
export { NonFiniteError, TrainingError, TrainingSession } from './session.js';
export { readState, StateError, writeState } from './state.js';
export { arrayOf, readSafetensors, writeSafetensors } from './safetensors.js';
export { readModel, withInitializers } from './onnx.js';
