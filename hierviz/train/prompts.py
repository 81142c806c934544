"""Training prompts for the offline stack: our own templates x topic lists, per category.

None of these is taken from Spec-Bench or MT-Bench; `overlap_report` checks that
programmatically (no exact match and no shared word 8-gram with any question turn).
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Iterable, Optional

SUBJECTS = [
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the immune system", "plate tectonics",
    "climate change", "renewable energy", "the French Revolution", "the Silk Road", "ancient Rome",
    "the printing press", "the Industrial Revolution", "honeybees", "coral reefs", "rainforests", "deserts",
    "the human heart", "sleep", "memory", "vaccines", "antibiotics", "electric cars", "solar panels",
    "the internet", "smartphones", "artificial intelligence", "machine learning", "blockchain",
    "cloud computing", "recycling", "composting", "urban gardening", "public transport", "bicycles",
    "the Moon", "Mars", "the Sun", "comets", "gravity", "magnetism", "electricity", "sound waves", "light",
    "rainbows", "earthquakes", "tsunamis", "hurricanes", "glaciers", "rivers", "mountains", "oceans",
    "dinosaurs", "evolution", "DNA", "cells", "bacteria", "fungi", "bread baking", "coffee", "tea", "chocolate",
    "olive oil", "rice farming", "the stock market", "inflation", "taxes", "saving money", "budgeting",
    "job interviews", "remote work", "time management", "public speaking", "learning a language",
    "chess", "football", "the Olympic Games", "marathon running", "yoga", "meditation", "music theory",
    "jazz", "classical music", "painting", "photography", "film making", "poetry", "theatre", "libraries",
    "museums", "democracy", "human rights", "the United Nations", "elections", "friendship", "kindness",
    "pets", "dogs", "cats", "birds migration", "whales", "elephants", "penguins", "forests", "wind power",
    "nuclear energy", "batteries", "3D printing", "robots", "satellites", "GPS", "bridges", "skyscrapers",
    "roads", "trains", "airplanes", "ships", "maps", "calendars", "clocks", "writing systems", "numbers",
    "prime numbers", "probability", "geometry", "algebra", "statistics", "fractions", "percentages",
]

AUDIENCES = ["a child", "a teenager", "a beginner", "a college student", "a busy parent", "a retired teacher",
             "a software engineer", "a farmer", "a nurse", "a tourist", "a small business owner", "an artist"]

WRITING_TOPICS = [
    "a lighthouse keeper who finds a message in a bottle", "a robot learning to paint", "a village without clocks",
    "a cat that runs a bakery", "the last tree in a city", "a train that never stops", "a library at midnight",
    "a girl who can talk to rivers", "an astronaut's first day back on Earth", "a dragon afraid of fire",
    "two strangers sharing an umbrella", "a forgotten birthday", "a garden on a rooftop", "a snowstorm in April",
    "a detective who solves crimes with smells", "a musician who lost her hearing", "a map that changes every night",
    "a bicycle trip across the country", "the first rain after a long drought", "a grandmother's recipe book",
    "a tiny island with one shop", "a clockmaker's apprentice", "a kite festival", "a lost key",
    "a city under the sea", "a chess match between old friends", "moving to a new town", "a night market",
    "an old radio that plays tomorrow's news", "a fox and a crow who become partners",
]
WRITING_TEMPLATES = [
    "Write a short story about {w}.", "Write a poem about {w}.", "Write a haiku sequence about {w}.",
    "Write the opening paragraph of a novel about {w}.", "Write a children's bedtime story about {w}.",
    "Write a diary entry from the point of view of someone living through {w}.",
    "Write a short dialogue between two characters about {w}.", "Write a limerick about {w}.",
    "Describe {w} in vivid detail, using all five senses.", "Write a fable about {w} that ends with a moral.",
]
WRITING_TEMPLATES_S = [
    "Write a blog post introduction about {s}.", "Write a persuasive paragraph about why people should care about {s}.",
    "Write a short speech for a school assembly about {s}.", "Write a product description for a board game about {s}.",
    "Write a friendly newsletter paragraph about {s}.", "Write a short essay on the history of {s}.",
    "Write an encouraging note to {a} who wants to learn about {s}.", "Write five catchy slogans about {s}.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n", "sorts a list with merge sort",
    "finds the largest element in a list", "counts the vowels in a string", "returns the nth Fibonacci number",
    "removes duplicates from a list while keeping order", "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit", "computes the average of a list of numbers", "merges two sorted lists",
    "implements binary search", "counts word frequencies in a text", "flattens a nested list",
    "validates an email address with a simple rule", "computes the greatest common divisor of two numbers",
    "transposes a matrix", "finds the second smallest number in a list", "reads a CSV file and sums a column",
    "implements a stack with push and pop", "implements a queue using two stacks", "checks balanced parentheses",
    "converts a decimal number to binary", "generates all subsets of a set", "rotates a list by k positions",
    "capitalizes the first letter of every word", "finds the longest word in a sentence", "computes the power set",
    "checks whether two strings are anagrams", "returns the digits of an integer as a list",
    "computes the sum of squares from 1 to n", "finds common elements of two lists", "implements bubble sort",
    "counts the lines in a text file", "builds a dictionary from two lists", "returns the median of a list",
]
LANGUAGES = ["Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "TypeScript", "Bash"]
CODE_TEMPLATES = [
    "Write a {l} function that {c}.", "Show how to write a program in {l} that {c}, and explain each step.",
    "Write a {l} function that {c}. Add comments and a small usage example.",
    "How would you test a {l} function that {c}? Give a few test cases.",
    "Explain the time complexity of a function that {c}, with an example in {l}.",
]
CODE_CONCEPTS = ["recursion", "a hash map", "a linked list", "a binary tree", "object-oriented programming",
                 "a closure", "an API", "version control with git", "unit testing", "a SQL join", "a regular expression",
                 "big-O notation", "a race condition", "garbage collection", "a REST endpoint", "a for loop",
                 "exceptions", "type hints", "a virtual environment", "dynamic programming", "a graph search",
                 "a compiler", "an operating system", "a database index", "caching"]
CODE_CONCEPT_TEMPLATES = ["Explain {k} to a new programmer.", "What is {k}? Give a short code example.",
                          "What are common mistakes beginners make with {k}?", "When should I use {k}?"]


def _math_prompts(rng: random.Random, n: int) -> list[str]:
    items = ["apples", "pencils", "books", "marbles", "cookies", "stamps", "tickets", "coins", "eggs", "flowers"]
    people = ["Ana", "Ben", "Chen", "Dara", "Elif", "Femi", "Gita", "Hugo", "Ines", "Jon", "Kofi", "Lena"]
    out = []
    for _ in range(n):
        kind = rng.randrange(10)
        a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
        p, q = rng.sample(people, 2)
        it = rng.choice(items)
        if kind == 0:
            out.append(f"{p} has {a} {it}. {q} gives {p} {b} more, and then {p} shares them equally among {c} friends. "
                       f"How many {it} does each friend get, and how many are left over?")
        elif kind == 1:
            out.append(f"Solve for x: {a}x + {b} = {a * c + b}. Show your steps.")
        elif kind == 2:
            out.append(f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?")
        elif kind == 3:
            out.append(f"What is {a}% of {b * 10}? Explain how you calculate it.")
        elif kind == 4:
            out.append(f"A train travels {a * 5} km in {c} hours. What is its average speed? How far would it go in {c + 2} hours?")
        elif kind == 5:
            out.append(f"Compute {a} x {b} - {c} and explain the order of operations.")
        elif kind == 6:
            out.append(f"{p} saves {b} dollars every week. How many weeks does {p} need to save {b * a} dollars?")
        elif kind == 7:
            out.append(f"What is the least common multiple of {a} and {b}? And their greatest common divisor?")
        elif kind == 8:
            out.append(f"A bag has {a} red and {b} blue {it}. If you pick one at random, what is the probability it is red?")
        else:
            out.append(f"Simplify the fraction {a * c}/{b * c} and write it as a decimal.")
    return out


MATH_CONCEPTS = ["the Pythagorean theorem", "prime factorization", "the order of operations", "negative numbers",
                 "square roots", "the area of a circle", "compound interest", "linear equations", "averages",
                 "ratios", "exponents", "place value", "long division", "the mean and the median",
                 "simple probability", "angles in a triangle", "unit conversion", "scientific notation"]
MATH_TEMPLATES = ["Explain {m} with a worked example.", "Teach {a} how {m} works.",
                  "Give three practice problems about {m}, with answers."]

REASONING_TEMPLATES = [
    "What are the pros and cons of {s}?", "Compare {s} and {s2}. How are they alike and how do they differ?",
    "Why is {s} important? Give three reasons.", "What would happen if {s} suddenly disappeared?",
    "Give a step-by-step plan for someone who wants to get started with {s}.",
    "What are the most common misconceptions about {s}?", "Argue for and against spending public money on {s}.",
]
PUZZLES = [
    "If all cats are animals and some animals are black, can we conclude that some cats are black? Explain.",
    "I have two coins that add up to 30 cents and one of them is not a nickel. What are the coins?",
    "A farmer has chickens and cows: 20 heads and 56 legs in total. How many of each animal are there?",
    "Which is heavier, a kilogram of feathers or a kilogram of iron? Explain why.",
    "If it takes 5 machines 5 minutes to make 5 widgets, how long do 100 machines need for 100 widgets?",
    "Tom is taller than Sam, and Sam is taller than Lee. Who is the shortest? Explain your reasoning.",
    "A clock shows 3:15. What is the angle between the hour and minute hands?",
    "There are three boxes labeled apples, oranges and mixed, and every label is wrong. How can you fix the labels by picking one fruit?",
    "What comes next in the sequence 2, 6, 12, 20, 30? Explain the pattern.",
    "If today is Wednesday, what day of the week will it be in 100 days?",
]

QA_TEMPLATES = [
    "What is {s}?", "How does {s} work?", "Explain {s} to {a}.", "Give me five interesting facts about {s}.",
    "What is the history of {s}?", "Summarize what scientists know about {s}.", "How has {s} changed over time?",
    "What questions do people usually ask about {s}, and what are the answers?", "Describe {s} in simple words.",
]

PASSAGE_BITS = [
    "The town council met on Monday to discuss the new bus routes.", "Several residents asked for more frequent service.",
    "The budget for the project is limited.", "A local bakery won a regional prize last spring.",
    "Its owner started baking at the age of twelve.", "The bakery now employs eight people.",
    "Researchers tracked sea turtles for three years.", "They found that the turtles returned to the same beaches.",
    "Warmer sand changes the ratio of male and female hatchlings.", "The museum reopened after a long renovation.",
    "New rooms show tools used by early farmers.", "Entry is free for students on Fridays.",
    "The company released a smaller phone with a larger battery.", "Reviewers praised the camera but not the price.",
    "Sales were strongest in the first week.", "Heavy rain flooded two roads near the river.",
    "Volunteers filled sandbags through the night.", "No one was hurt, and the roads reopened by noon.",
    "The school started a reading club for younger pupils.", "Older students read aloud twice a week.",
    "Teachers say that reading scores have improved.", "A new park opened on the site of an old factory.",
    "It has a playground, a pond and a small orchard.", "Neighbors planted the first trees together.",
]
SUMMARY_TEMPLATES = ["Summarize the following text in one sentence:\n\n{p}", "Give the main points of this text as a bullet list:\n\n{p}",
                     "Write a headline for this news item:\n\n{p}", "Summarize this for a child:\n\n{p}"]
EXTRACT_TEMPLATES = ["List every number mentioned in this text:\n\n{p}", "Which people, places or organizations appear in this text?\n\n{p}",
                     "Turn this text into a JSON object with the keys 'topic' and 'facts':\n\n{p}",
                     "Write two questions that can be answered from this text, with the answers:\n\n{p}"]

SENTENCES = [
    "The weather is lovely today.", "Where is the nearest train station?", "I would like a cup of coffee, please.",
    "My brother lives in a small village.", "We are going to the beach tomorrow.", "This book is very interesting.",
    "Can you help me find my keys?", "The museum opens at nine o'clock.", "She plays the piano every evening.",
    "How much does this jacket cost?", "I am learning to cook new dishes.", "The children are playing in the garden.",
    "Please close the window, it is cold.", "Our meeting has been moved to Thursday.", "Thank you for your kind letter.",
    "The cat is sleeping on the sofa.", "I forgot my umbrella at home.", "Let's meet in front of the library.",
]
TARGET_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
TRANSLATE_TEMPLATES = ["Translate into {t}: \"{x}\"", "How do you say \"{x}\" in {t}?",
                       "Translate this sentence to {t} and explain any difficult words: {x}"]

ROLES = ["a friendly tour guide in an old city", "a pirate captain", "a medieval knight", "a patient math tutor",
         "a chef on a cooking show", "a museum guide", "a sports coach", "a space station commander",
         "a travel agent", "a wise old owl", "a detective", "a gardener", "a librarian", "a news reporter"]
ROLE_TASKS = ["introduce yourself", "give me advice about {s}", "explain {s} to me", "tell me about your day",
              "describe your favorite place", "answer my question: what should I learn first about {s}?"]
ROLE_TEMPLATES = ["Pretend you are {r}. Please {t}.", "You are {r}. Stay in character and {t}."]

ADVICE_TEMPLATES = ["Give me tips for {x}.", "How can I get better at {x}?", "Make a one-week plan for {x}.",
                    "What equipment or resources do I need for {x}?", "What are five mistakes to avoid when {x}?"]
ADVICE_TOPICS = ["running my first 5 km race", "studying for exams", "keeping a houseplant alive", "cooking for a family",
                 "starting a vegetable garden", "learning to draw", "writing a cover letter", "organizing my desk",
                 "sleeping better", "drinking more water", "reading more books", "saving for a holiday",
                 "learning to swim", "planning a birthday party", "moving to a new apartment", "training a puppy",
                 "making new friends in a new city", "preparing for a job interview", "learning to play guitar",
                 "reducing screen time", "cooking rice", "packing for a camping trip"]

REWRITE_SENTENCES = ["me and him goes to the store yesterday", "the report was wrote by the team in a hurry",
                     "their going to there house later", "i has three cat and one dogs",
                     "the meeting that we was having it was too long", "she dont like vegetables but she eat them"]
REWRITE_TEMPLATES = ["Correct the grammar in this sentence: {x}", "Rewrite this sentence formally: {x}",
                     "Fix the mistakes and explain them: {x}"]


def _passage(rng: random.Random) -> str:
    start = rng.randrange(0, len(PASSAGE_BITS) - 2, 3)
    bits = PASSAGE_BITS[start:start + 3]
    if rng.random() < 0.5:
        bits = bits + rng.sample(PASSAGE_BITS, 2)
    return " ".join(bits)


def build_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n distinct (category, prompt) pairs, a deterministic mix over all categories."""
    rng = random.Random(seed)
    cats: dict[str, list[str]] = {}
    cats["writing"] = [t.format(w=w) for t in WRITING_TEMPLATES for w in WRITING_TOPICS] + \
        [t.format(s=s, a=rng.choice(AUDIENCES)) for t in WRITING_TEMPLATES_S for s in SUBJECTS]
    cats["coding"] = [t.format(l=l, c=c) for t in CODE_TEMPLATES for l in LANGUAGES for c in CODE_TASKS] + \
        [t.format(k=k) for t in CODE_CONCEPT_TEMPLATES for k in CODE_CONCEPTS]
    cats["math"] = _math_prompts(rng, 1500) + [t.format(m=m, a=a) for t in MATH_TEMPLATES for m in MATH_CONCEPTS
                                                for a in AUDIENCES[:4]]
    cats["reasoning"] = [t.format(s=s, s2=rng.choice(SUBJECTS)) for t in REASONING_TEMPLATES for s in SUBJECTS] + PUZZLES * 3
    cats["qa"] = [t.format(s=s, a=rng.choice(AUDIENCES)) for t in QA_TEMPLATES for s in SUBJECTS]
    cats["summarization"] = [rng.choice(SUMMARY_TEMPLATES).format(p=_passage(rng)) for _ in range(400)]
    cats["extraction"] = [rng.choice(EXTRACT_TEMPLATES).format(p=_passage(rng)) for _ in range(300)]
    cats["translation"] = [t.format(t=lang, x=x) for t in TRANSLATE_TEMPLATES for lang in TARGET_LANGS for x in SENTENCES]
    cats["roleplay"] = [t.format(r=r, t=task.format(s=rng.choice(SUBJECTS))) for t in ROLE_TEMPLATES for r in ROLES
                        for task in ROLE_TASKS]
    cats["advice"] = [t.format(x=x) for t in ADVICE_TEMPLATES for x in ADVICE_TOPICS]
    cats["rewriting"] = [t.format(x=x) for t in REWRITE_TEMPLATES for x in REWRITE_SENTENCES]
    weights = {"writing": 0.16, "coding": 0.16, "math": 0.12, "reasoning": 0.11, "qa": 0.14, "summarization": 0.06,
               "extraction": 0.05, "translation": 0.05, "roleplay": 0.06, "advice": 0.07, "rewriting": 0.02}
    pools = {}
    for c, items in cats.items():
        uniq = sorted(set(items))
        rng.shuffle(uniq)
        pools[c] = uniq
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    names = list(weights)
    ptr = {c: 0 for c in names}
    while len(out) < n:
        progressed = False
        for c in rng.choices(names, [weights[x] for x in names], k=64):
            if ptr[c] < len(pools[c]):
                p = pools[c][ptr[c]]
                ptr[c] += 1
                progressed = True
                if p not in seen:
                    seen.add(p)
                    out.append((c, p))
                    if len(out) >= n:
                        break
        if not progressed and all(ptr[c] >= len(pools[c]) for c in names):
            break  # every pool used up: fewer prompts than asked
    return out


# ---- derived prompts: T's own answers as passages ---------------------------------------------
# The template prompts above are short; benchmark prompts are often long (a passage to summarise,
# a document to answer from, text to translate or rewrite). Derived prompts reuse responses the
# target already wrote as passages, which costs no corpus and stays in the target's own style.
DERIVED_TEMPLATES: dict[str, list[str]] = {
    "summarization": ["Summarize the following text in two sentences.\n\n{p}",
                      "Write a one-paragraph summary of this text for {a}:\n\n{p}",
                      "Give a short title and a three-bullet summary of the text below.\n\n{p}"],
    "qa": ["Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: What is the main point of the passage?",
           "Based only on the text below, what advice would you give to {a}?\n\n{p}",
           "Here is a document:\n\n{p}\n\nWhich statement in the document is the most important, and why?"],
    "extraction": ["List every concrete fact, number or name mentioned in this text as a bulleted list.\n\n{p}",
                   "Extract the key terms from the following text and define each in a few words.\n\n{p}"],
    "translation": ["Translate the following text into {lang}.\n\n{p}"],
    "rewriting": ["Rewrite the following text so that {a} can understand it.\n\n{p}",
                  "Make the following text shorter and more formal.\n\n{p}",
                  "Find and fix any unclear sentences in this text, then give the improved version.\n\n{p}"],
    "reasoning": ["Is there anything in the following text that could be wrong or misleading? Explain step by step.\n\n{p}"],
}


def derived_prompts(passages: list[str], seed: int = 0) -> list[tuple[str, str]]:
    """One (category, prompt) per passage: a derived task on that passage, categories in turn."""
    rng = random.Random(seed)
    kinds = sorted(DERIVED_TEMPLATES)
    out = []
    for i, text in enumerate(passages):
        kind = kinds[i % len(kinds)]
        t = rng.choice(DERIVED_TEMPLATES[kind])
        out.append((f"derived-{kind}", t.format(p=text.strip(), a=rng.choice(AUDIENCES),
                                                lang=rng.choice(TARGET_LANGS))))
    return out


# ---- self-instruct prompts: questions and tasks the target writes itself ---------------------------
# Template prompts repeat a few sentence shapes; benchmark questions do not. Asking the target to
# write a question or task (sampled, so each one differs) and then answering it gives prompts in
# many more shapes, still without any benchmark text (the overlap rule applies to them too).
INSTRUCT_TEMPLATES: dict[str, list[str]] = {
    "qa": ["Write one question that {a} might ask about {s}. Reply with the question only.",
           "Write a trivia question about {s}. Reply with the question only.",
           "Write a question about a famous person, place or event connected to {s}. Reply with the question only."],
    "writing": ["Write a short writing task (an email, story, poem, essay, speech or letter) about {s} for someone else "
                "to do. Reply with the task only.",
                "Write a request that asks for a blog post or an article about {s}, with two or three specific "
                "requirements. Reply with the request only."],
    "math": ["Write a math word problem about {s} that uses numbers. Reply with the problem only.",
             "Write an arithmetic or algebra question that {a} could solve. Reply with the question only."],
    "reasoning": ["Write a question that asks someone to compare {s} and {s2}. Reply with the question only.",
                  "Write a logic puzzle or riddle. Reply with the puzzle only.",
                  "Write a question asking why something about {s} happens. Reply with the question only."],
    "coding": ["Write a programming task in {l} related to {s}. Reply with the task only.",
               "Write a question a programmer might ask about {k}. Reply with the question only."],
    "stem": ["Write an exam question about {s} for a science class. Reply with the question only."],
    "humanities": ["Write an essay question about history, art or society related to {s}. Reply with the question only."],
    "roleplay": ["Write an instruction that asks an assistant to pretend to be someone and talk about {s}. "
                 "Reply with the instruction only."],
    "extraction": ["Write a short news report (three or four sentences) about {s}, then on a new line ask a question "
                   "that can be answered from it."],
}


def instruct_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (category, prompt) pairs asking the target to write a question or task of that category."""
    rng = random.Random(seed)
    cats = sorted(INSTRUCT_TEMPLATES)
    out = []
    for i in range(n):
        c = cats[i % len(cats)]
        t = rng.choice(INSTRUCT_TEMPLATES[c])
        out.append((c, t.format(s=rng.choice(SUBJECTS), s2=rng.choice(SUBJECTS), a=rng.choice(AUDIENCES),
                                l=rng.choice(LANGUAGES), k=rng.choice(CODE_CONCEPTS))))
    return out


IMPERATIVES = frozenset(
    "write explain describe list create give compare summarize summarise calculate solve translate design implement "
    "find suggest plan compose draft tell imagine pretend discuss analyze analyse outline propose rewrite convert "
    "classify identify evaluate define name recommend generate develop build make prepare read show teach help use "
    "choose estimate prove argue predict research".split())
REFUSALS = ("i'm not", "i am not", "as an ai", "i cannot", "i can't", "sorry", "i don't")


def parse_instruction(text: str, min_words: int = 4, max_words: int = 120) -> Optional[str]:
    """The question or task in a target-written reply, or None when it is unusable. Strips quotes,
    list markers and "Question:" labels; keeps the text up to its last question mark, or the whole
    text when it starts with an imperative ("Write ...", "Explain ..."); anything else (a story
    instead of a task, a refusal) and anything too short or too long is dropped."""
    t = text.strip()
    t = re.sub(r"^(?:\*\*)?(?:question|task|problem|request|instruction|puzzle|riddle)\s*(?:\d+)?\s*:\s*(?:\*\*)?",
               "", t, flags=re.I).strip()
    t = re.sub(r"^(?:\d+[.)]|[-*])\s+", "", t).strip().strip('"').strip("\u201c\u201d").strip()
    low = t.lower()
    if low.startswith(REFUSALS):
        return None
    if "?" in t:
        t = t[:t.rindex("?") + 1].strip()
    elif (re.match(r"[a-z]+", low) or [""])[0] not in IMPERATIVES:
        return None
    n = len(t.split())
    if n < min_words or n > max_words:
        return None
    return t


# ---- the non-overlap check -----------------------------------------------------------------------

def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def question_turns(paths: Iterable[str | Path]) -> list[str]:
    turns = []
    for p in paths:
        for line in Path(p).read_text(encoding="utf-8").splitlines():
            if line.strip():
                q = json.loads(line)
                turns.extend(t for t in q.get("turns", []) if isinstance(t, str))
    return turns


def _overlaps(prompts: list[str], question_files: list[str | Path], n: int) -> tuple[list[str], list[str], int]:
    """(prompts equal to a benchmark turn, prompts sharing a word n-gram with one, number of turns)."""
    turns = question_turns(question_files)
    norm = lambda s: " ".join(_words(s))  # noqa: E731
    turn_set = {norm(t) for t in turns}
    bench_grams: set[tuple[str, ...]] = set()
    for t in turns:
        bench_grams |= ngrams(t, n)
    exact = [p for p in prompts if norm(p) in turn_set]
    shared = [p for p in prompts if ngrams(p, n) & bench_grams]
    return exact, shared, len(turns)


def overlapping_prompts(prompts: list[str], question_files: list[str | Path], n: int = 8) -> set[str]:
    """The prompts that equal a benchmark turn or share a word n-gram with one."""
    exact, shared, _ = _overlaps(prompts, question_files, n)
    return set(exact) | set(shared)


def overlap_report(prompts: list[str], question_files: list[str | Path], n: int = 8) -> dict:
    """Exact-match and shared word-n-gram counts between training prompts and benchmark turns."""
    exact, shared, n_turns = _overlaps(prompts, question_files, n)
    return {"question_files": [str(Path(q).name) for q in question_files], "benchmark_turns": n_turns,
            "training_prompts": len(prompts), "ngram": n, "exact_matches": len(exact),
            "prompts_sharing_an_ngram": len(shared), "examples": shared[:5]}
