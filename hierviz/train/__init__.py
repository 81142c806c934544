"""Training commands for the offline default stack.

    python -m hierviz train data       T's own answers to our prompts (+ non-overlap check, FR-Spec vocab)
    python -m hierviz train distill    M: layers of T distilled with KL(T||M), then GPTQ W4 (AutoGPTQ layout)
    python -m hierviz train eagle      E_T and E_M: EAGLE-1/2 heads in SafeAILab's layout
    python -m hierviz train agreement  M's top-1 agreement with T on T's answers to benchmark questions

Each module exposes main(argv); hierviz/train/cli.py dispatches the stage names to them.
hierviz/train/gpu_pipeline.sh chains data, distill and eagle on the GPU; docs/training.md and
assets/models/PROVENANCE.md record how the shipped files were produced.
"""
