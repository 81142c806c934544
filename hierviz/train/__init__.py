"""Training commands for the offline default stack (DESIGN 6, issue 4).

    python -m hierviz.train.data         T's own answers to our prompts (+ non-overlap check, FR-Spec vocab)
    python -m hierviz.train.distill      M: layers of T distilled with KL(T||M), then GPTQ W4 (AutoGPTQ layout)
    python -m hierviz.train.eagle_train  E_T and E_M: EAGLE-1/2 heads in SafeAILab's layout

Each module exposes main(argv). hierviz/train/gpu_pipeline.sh chains them as run on the GPU;
docs/training.md and assets/models/PROVENANCE.md record the run that produced the shipped files.
"""
