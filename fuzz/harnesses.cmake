# The fuzz harnesses, as "name:library,library...". Each is fuzz/<name>_fuzzer.cc, built as
# loom-fuzz-<name> by the fuzz build (fuzz/CMakeLists.txt), with its seed corpus in
# fuzz/corpus/<name>/ that ctest replays (cmake/LoomFuzz.cmake).
set(LOOM_FUZZERS
    job_spec:loom_spec,loom_task_spec
    set_overrides:loom_spec
    safetensors:loom_storage
    checkpoint_manifest:loom_storage,loom_spec
    s3_xml:loom_s3
    tokenizer_json:loom_data
    sentencepiece_model:loom_tokenizer
    trainer_events:loom_events
    hf_import:loom_interop
    chat_jsonl:loom_data
    token_index:loom_data
    serve_request:loom_serve_request
    rest_routes:loom_coordinator_core)
