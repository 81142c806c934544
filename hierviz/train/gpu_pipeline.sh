#!/usr/bin/env bash
# The whole offline-stack training run, as executed on the device GPU (one H200):
#   bash hierviz/train/gpu_pipeline.sh TARGET.gguf TOKENIZER_DIR WORK_DIR OUT_DIR
# Budgets (seconds) come from the environment: DATA_S, DISTILL_S, EAGLE_S; STAGES (default
# "data distill heads") runs a subset, reusing WORK_DIR's products of the others (e.g. one device call
# for "data distill", the next for "heads" with a full EAGLE_S, so one call's 600 s limit does
# not cap the whole pipeline); sizes from
# NUM_PROMPTS, GEN_BATCH, MAX_NEW, MODES, SAMPLES_PER_PROMPT, DERIVED (+ DERIVED_S), INSTRUCT (+ INSTRUCT_S), LAYERS,
# GROUP, TOP1, LR, EAGLE_LR, SEED (new prompts and batch orders); INIT=FILE continues the distillation from a saved student (every distill stage leaves
# WORK_DIR/M_float.safetensors, so a second call can go on where the first stopped; INIT=M_DIR starts
# from a shipped M checkpoint); INIT_M / INIT_T=HEAD_DIR start E_M / E_T from a saved head; HEADS=m (t) trains only E_M (E_T) (E_T depends
# on T alone, so a new M does not need a new E_T). Every stage logs to OUT_DIR/log.txt and leaves its
# products in OUT_DIR as it finishes, so a run cut short still returns what it made.
set -uo pipefail
T=$1; TOK=$2; W=$3; OUT=$4
mkdir -p "$W" "$OUT"
Q="${QUESTIONS-assets/data/spec_bench_question.jsonl assets/data/mt_bench_question.jsonl}"   # QUESTIONS="" skips the overlap check
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
STAGES=" ${STAGES:-data distill heads} "
has() { [[ "$STAGES" == *" $1 "* ]]; }
if [ ! -f "$W/target/config.json" ]; then
  $PY -c "import sys; from hierviz.train.common import export_float; export_float(sys.argv[1], sys.argv[2])" "$T" "$W/target" || exit 1
fi
SRC=$T; T=$W/target   # exact dequantized copy of the GGUF target (fp32), fast to reload
echo "target $SRC as fp32 in $T; stages:$STAGES"
MDIR=smollm2-m${LAYERS:-8}-gptq
if has data; then
$PY -m hierviz train data --target "$T" --tokenizer "$TOK" --out "$W/data.pt" \
  --num-prompts "${NUM_PROMPTS:-8000}" --samples-per-prompt "${SAMPLES_PER_PROMPT:-1}" --max-new-tokens "${MAX_NEW:-256}" \
  --batch-size "${GEN_BATCH:-1024}" --modes "${MODES:-greedy:0.5,t0.7:0.25,t1.0:0.25}" --time-budget "${DATA_S:-90}" ${Q:+--questions $Q} \
  --derived "${DERIVED:-0}" --derived-budget "${DERIVED_S:-0}" \
  --instruct "${INSTRUCT:-0}" --instruct-budget "${INSTRUCT_S:-0}" \
  --draft-vocab "${DRAFT_VOCAB:-8192}" --draft-vocab-out "$W/draft_vocab.json" ${SEED:+--seed $SEED} \
  --report "$W/data.json" || exit 1
cp "$W/data.pt" "$W/data.json" "$W/draft_vocab.json" "$OUT/" 2>/dev/null
fi
if has distill; then
$PY -m hierviz train distill --target "$T" --data "$W/data.pt" --out "$W/$MDIR" \
  --layers "${LAYERS:-8}" --steps "${DISTILL_STEPS:-4000}" --time-budget "${DISTILL_S:-150}" \
  --batch-tokens "${BATCH_TOKENS:-16384}" --group-size "${GROUP:-64}" --top1-weight "${TOP1:-0}" \
  --save-float "$W/M_float.safetensors" ${INIT:+--init "$INIT"} --lr "${LR:-4e-4}" ${SEED:+--seed $SEED} \
  --report "$W/distill.json" || exit 2
cp "$W/distill.json" "$OUT/"
tar -C "$W" -cf "$OUT/M.tar" "$MDIR"
fi
if has heads; then
# HEAD_TYPE=eagle3: EAGLE-3 heads (training-time test over TTT steps) over DRAFT_VOCAB_FILE's first DV_T
# (E_T) / DV_M (E_M) tokens, MLP width HEAD_INTER; INTERMEDIATE=M_DIR trains E_M on a given (e.g. the
# shipped) M instead of this run's
HT=${HEAD_TYPE:-eagle2}
SFX=eagle; [ "$HT" = eagle3 ] && SFX=eagle3
MPATH=${INTERMEDIATE:-$W/$MDIR}
HEAD_OUT="--out-t $W/smollm2-$SFX-t ${INIT_T:+--init-t $INIT_T} --out-m $W/smollm2-m${LAYERS:-8}-$SFX ${INIT_M:+--init-m $INIT_M}"
[ "${HEADS:-mt}" = m ] && HEAD_OUT="--out-m $W/smollm2-m${LAYERS:-8}-$SFX ${INIT_M:+--init-m $INIT_M}"
[ "${HEADS:-mt}" = t ] && HEAD_OUT="--out-t $W/smollm2-$SFX-t ${INIT_T:+--init-t $INIT_T}"
E3=""
[ "$HT" = eagle3 ] && E3="--head-type eagle3 --ttt-steps ${TTT:-7} --draft-vocab ${DRAFT_VOCAB_FILE:-$W/draft_vocab.json} ${DV_T:+--draft-vocab-size $DV_T} ${DV_M:+--draft-vocab-size-m $DV_M} ${HEAD_INTER:+--head-intermediate-size $HEAD_INTER}"
$PY -m hierviz train eagle --target "$T" --intermediate "$MPATH" --data "$W/data.pt" \
  $HEAD_OUT $E3 --steps "${EAGLE_STEPS:-4000}" --lr "${EAGLE_LR:-6e-4}" \
  --time-budget "${EAGLE_S:-150}" --batch-tokens "${BATCH_TOKENS:-16384}" --report "$W/eagle.json" || exit 3
cp "$W/eagle.json" "$OUT/"
tar -C "$W" -cf "$OUT/heads.tar" $(cd "$W" && ls -d smollm2-$SFX-t smollm2-m*-$SFX 2>/dev/null)
fi
} 2>&1 | tee -a "$OUT/log.txt"
